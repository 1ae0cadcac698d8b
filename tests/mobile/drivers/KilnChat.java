import ai.kiln.KilnEngine;
import ai.kiln.KilnException;

/**
 * A Java app of ai.kiln.KilnEngine, for tests/mobile/test_java.py: args are the engine's config, then
 * requests; prints "chunk <json>" per chunk and "status <code> <message>" after each request
 * ("abort-after <k> <json>" aborts from a second thread once k chunks came).
 */
public final class KilnChat {
  public static void main(String[] args) throws Exception {
    KilnEngine engine;
    try {
      engine = new KilnEngine(args[0]);
    } catch (KilnException e) {
      System.out.println("status " + e.code() + " " + e.getMessage());
      return;
    }
    try (engine) {
      for (int i = 1; i < args.length; i++) {
        String request = args[i];
        int abortAfter = 0;
        if (request.startsWith("abort-after ")) {
          String[] parts = request.split(" ", 3);
          abortAfter = Integer.parseInt(parts[1]);
          request = parts[2];
        }
        int[] chunks = {0};
        final int due = abortAfter;
        try {
          engine.chatCompletion(request, chunk -> {
            System.out.println("chunk " + chunk);
            chunks[0] += 1;
            if (due > 0 && chunks[0] == due) {
              Thread aborter = new Thread(engine::abort);
              aborter.start();
              try {
                aborter.join();
              } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
              }
            }
            return true;
          });
          System.out.println("status - ");
        } catch (KilnException e) {
          System.out.println("status " + e.code() + " " + e.getMessage());
        }
      }
    }
  }
}
