"""The ingest stage: a model source (a Hugging Face folder or hub id, a GGUF file) read and checked,
its weights and tokenizer resolved inside its folder."""
