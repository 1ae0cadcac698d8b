package ai.kiln;

/** A failure of the engine: the C API's status, the error code the browser engine uses, and why. */
public final class KilnException extends Exception {
  private static final long serialVersionUID = 1L;
  private final int status;
  private final String code;

  public KilnException(int status, String code, String message) {
    super(message);
    this.status = status;
    this.code = code;
  }

  /** kiln.h's status (KILN_BAD_REQUEST, ...); -1 where the call gives none (creating the engine, tokenizing). */
  public int status() {
    return status;
  }

  /** "bad-request", "context-window-exceeded", "integrity", ... (web/src/errors.js's codes). */
  public String code() {
    return code;
  }
}
