package ai.kiln;

import java.nio.charset.StandardCharsets;

/**
 * Kiln's engine for Java and Kotlin apps, over kiln.h: load a compiled model, stream OpenAI chat
 * completions as JSON. One completion at a time per engine; {@link #abort()} may come from any thread.
 *
 * <pre>{@code
 * try (KilnEngine engine = new KilnEngine("{\"model\": \"/data/models/SmolLM2\"}")) {
 *   engine.chatCompletion("{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}", chunk -> {
 *     System.out.println(chunk);
 *     return true;  // false stops the reply (finish_reason "abort")
 *   });
 * }
 * }</pre>
 */
public final class KilnEngine implements AutoCloseable {
  static {
    System.loadLibrary("kiln_jni");
  }

  /** Receives each {@code chat.completion.chunk} as JSON; returns false to stop the reply. */
  @FunctionalInterface
  public interface ChunkListener {
    boolean onChunk(String chunkJson);
  }

  private long handle;

  /** {@code configJson}: {"model": model folder, "model_lib": library path or "system://prefix"}. */
  public KilnEngine(String configJson) throws KilnException {
    handle = create(utf8(configJson));
  }

  /** Runs one chat completion (an OpenAI request as JSON), giving {@code listener} every chunk. */
  public void chatCompletion(String requestJson, ChunkListener listener) throws KilnException {
    chatCompletion(open(), utf8(requestJson), chunk -> listener.onChunk(new String(chunk, StandardCharsets.UTF_8)));
  }

  /** Ends the running completion after its current step (finish_reason "abort"); from any thread. */
  public void abort() {
    long current = handle;
    if (current != 0) {
      abort(current);
    }
  }

  /** Forgets the chat: the next completion prefills its whole prompt. */
  public void reset() throws KilnException {
    reset(open());
  }

  /** The ids of {@code text} in the model's tokenizer, as JSON: {"ids": [...]}. */
  public String tokenize(String text) throws KilnException {
    return new String(tokenize(open(), utf8(text)), StandardCharsets.UTF_8);
  }

  @Override
  public synchronized void close() {
    if (handle != 0) {
      free(handle);
      handle = 0;
    }
  }

  private long open() {
    if (handle == 0) {
      throw new IllegalStateException("the engine is closed");
    }
    return handle;
  }

  private static byte[] utf8(String text) {
    return text.getBytes(StandardCharsets.UTF_8);
  }

  /** What the native side calls for each chunk (UTF-8 bytes: JNI's own strings are not UTF-8). */
  interface RawListener {
    boolean onChunk(byte[] chunk);
  }

  private static native long create(byte[] configJson) throws KilnException;

  private static native void chatCompletion(long handle, byte[] requestJson, RawListener listener) throws KilnException;

  private static native void abort(long handle);

  private static native void reset(long handle) throws KilnException;

  private static native byte[] tokenize(long handle, byte[] text) throws KilnException;

  private static native void free(long handle);
}
