/* A C99 app of kiln.h, driven line by line on stdin by tests/mobile (each output line is one record):
 *   create <config json>          -> "created", or "status <n> <code> <message>"
 *   chat <request json>           -> "chunk <json>" per chunk, then "status <n> <code> <message>"
 *   stop-after <k> <request json> -> as chat, the callback asking to stop at the k-th chunk
 *   abort-after <k> <request json>-> as chat, a second thread calling kiln_abort once k chunks came
 *   pull <request json>           -> as chat, pulling the chunks (kiln_chat_completion_start, kiln_stream_next)
 *   pull-drop <k> <request json>  -> pulls k chunks, drops the stream, then "dropped"
 *   reset                         -> "status ..."
 *   tokenize <text>               -> "ids <json>" or "status ..."
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

#define LINE_BYTES (1 << 20)

static kiln_engine* engine = NULL;

struct listener {
  int chunks;
  int stop_after;  /* 0: never */
  int abort_after; /* 0: never */
  pthread_mutex_t lock;
  pthread_cond_t arrived;
};

static int on_chunk(const char* chunk_json, void* user) {
  struct listener* listener = user;
  printf("chunk %s\n", chunk_json);
  fflush(stdout);
  pthread_mutex_lock(&listener->lock);
  listener->chunks += 1;
  pthread_cond_signal(&listener->arrived);
  int stop = listener->stop_after > 0 && listener->chunks >= listener->stop_after;
  pthread_mutex_unlock(&listener->lock);
  return stop;
}

static void* abort_when_due(void* user) {
  struct listener* listener = user;
  pthread_mutex_lock(&listener->lock);
  while (listener->chunks < listener->abort_after) pthread_cond_wait(&listener->arrived, &listener->lock);
  pthread_mutex_unlock(&listener->lock);
  kiln_abort(engine);
  return NULL;
}

static void print_status(int status) {
  const char* code = kiln_last_error_code(engine);
  const char* message = kiln_last_error(engine);
  printf("status %d %s %s\n", status, code ? code : "-", message ? message : "");
  fflush(stdout);
}

static void chat(const char* request, int stop_after, int abort_after) {
  struct listener listener = {0, stop_after, abort_after, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};
  pthread_t aborter;
  if (abort_after > 0) pthread_create(&aborter, NULL, abort_when_due, &listener);
  int status = kiln_chat_completion(engine, request, on_chunk, &listener);
  if (abort_after > 0) {
    pthread_mutex_lock(&listener.lock);
    listener.chunks = abort_after; /* release the aborter if the reply ended first */
    pthread_cond_signal(&listener.arrived);
    pthread_mutex_unlock(&listener.lock);
    pthread_join(aborter, NULL);
  }
  print_status(status);
}

/* Pull the reply's chunks; with `drop_after` > 0, drop the stream after that many. */
static void pull(const char* request, int drop_after) {
  kiln_stream* stream = kiln_chat_completion_start(engine, request);
  if (stream == NULL) {
    print_status(-1);
    return;
  }
  int pulled = 0;
  const char* chunk;
  while ((drop_after == 0 || pulled < drop_after) && (chunk = kiln_stream_next(stream)) != NULL) {
    printf("chunk %s\n", chunk);
    pulled += 1;
  }
  if (drop_after > 0) {
    kiln_stream_free(stream);
    printf("dropped\n");
    fflush(stdout);
    return;
  }
  int status = kiln_stream_status(stream);
  kiln_stream_free(stream);
  print_status(status);
}

/* "<k> <rest>" -> k, and *rest after the space. */
static int count_then(char* text, char** rest) {
  int count = (int)strtol(text, rest, 10);
  if (**rest == ' ') *rest += 1;
  return count;
}

int main(void) {
  char* line = malloc(LINE_BYTES);
  while (fgets(line, LINE_BYTES, stdin)) {
    line[strcspn(line, "\n")] = '\0';
    char* argument = strchr(line, ' ');
    argument = argument ? argument + 1 : line + strlen(line);
    char* rest;
    if (strncmp(line, "create ", 7) == 0) {
      engine = kiln_engine_create(argument);
      if (engine) {
        printf("created\n");
        fflush(stdout);
      } else {
        print_status(-1);
      }
    } else if (strncmp(line, "chat ", 5) == 0) {
      chat(argument, 0, 0);
    } else if (strncmp(line, "stop-after ", 11) == 0) {
      int count = count_then(argument, &rest);
      chat(rest, count, 0);
    } else if (strncmp(line, "abort-after ", 12) == 0) {
      int count = count_then(argument, &rest);
      chat(rest, 0, count);
    } else if (strncmp(line, "pull ", 5) == 0) {
      pull(argument, 0);
    } else if (strncmp(line, "pull-drop ", 10) == 0) {
      int count = count_then(argument, &rest);
      pull(rest, count);
    } else if (strcmp(line, "reset") == 0) {
      print_status(kiln_reset(engine));
    } else if (strncmp(line, "tokenize ", 9) == 0) {
      const char* ids = kiln_tokenize(engine, argument);
      if (ids) {
        printf("ids %s\n", ids);
        fflush(stdout);
      } else {
        print_status(-1);
      }
    }
  }
  kiln_engine_free(engine);
  free(line);
  return 0;
}
