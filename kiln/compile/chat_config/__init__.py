"""The configure stage: mlc-chat-config.json, the tokenizer files beside it, and the conv_template
the browser engine and WebLLM lay chats out by (one file a conversation family in `conversations/`)."""
