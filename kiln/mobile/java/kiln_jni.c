/* The JNI side of ai.kiln.KilnEngine: a client of kiln.h only. Strings cross as UTF-8 bytes (JNI's
 * own "modified UTF-8" would garble characters outside the BMP, such as emoji). */
#include <jni.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

/* `bytes` as a NUL-terminated string (free it), or NULL with an OutOfMemoryError pending. */
static char* c_string(JNIEnv* env, jbyteArray bytes) {
  jsize length = (*env)->GetArrayLength(env, bytes);
  char* text = malloc((size_t)length + 1);
  if (text == NULL) {
    (*env)->ThrowNew(env, (*env)->FindClass(env, "java/lang/OutOfMemoryError"), "kiln: no memory for a string");
    return NULL;
  }
  (*env)->GetByteArrayRegion(env, bytes, 0, length, (jbyte*)text);
  text[length] = '\0';
  return text;
}

static jbyteArray java_bytes(JNIEnv* env, const char* text) {
  jsize length = (jsize)strlen(text);
  jbyteArray bytes = (*env)->NewByteArray(env, length);
  if (bytes != NULL) (*env)->SetByteArrayRegion(env, bytes, 0, length, (const jbyte*)text);
  return bytes;
}

static void throw_kiln(JNIEnv* env, int status, const kiln_engine* engine) {
  const char* code = kiln_last_error_code(engine);
  const char* message = kiln_last_error(engine);
  jclass type = (*env)->FindClass(env, "ai/kiln/KilnException");
  jmethodID init = (*env)->GetMethodID(env, type, "<init>", "(ILjava/lang/String;Ljava/lang/String;)V");
  jobject error = (*env)->NewObject(env, type, init, status, (*env)->NewStringUTF(env, code ? code : "internal"),
                                    (*env)->NewStringUTF(env, message ? message : "unknown error"));
  if (error != NULL) (*env)->Throw(env, (jthrowable)error);
}

static kiln_engine* engine_of(jlong handle) { return (kiln_engine*)(intptr_t)handle; }

JNIEXPORT jlong JNICALL Java_ai_kiln_KilnEngine_create(JNIEnv* env, jclass type, jbyteArray config) {
  char* text = c_string(env, config);
  if (text == NULL) return 0;
  kiln_engine* engine = kiln_engine_create(text);
  free(text);
  if (engine == NULL) throw_kiln(env, -1, NULL);
  return (jlong)(intptr_t)engine;
}

struct listener {
  JNIEnv* env;
  jobject target;
  jmethodID on_chunk;
};

/* Stops the reply when the listener says so or throws (its exception stays pending for Java). */
static int deliver(const char* chunk_json, void* user) {
  struct listener* listener = user;
  JNIEnv* env = listener->env;
  jbyteArray chunk = java_bytes(env, chunk_json);
  if (chunk == NULL) return 1;
  jboolean more = (*env)->CallBooleanMethod(env, listener->target, listener->on_chunk, chunk);
  (*env)->DeleteLocalRef(env, chunk);
  return (*env)->ExceptionCheck(env) || !more;
}

JNIEXPORT void JNICALL Java_ai_kiln_KilnEngine_chatCompletion(JNIEnv* env, jclass type, jlong handle,
                                                              jbyteArray request, jobject target) {
  char* text = c_string(env, request);
  if (text == NULL) return;
  jclass listener_type = (*env)->GetObjectClass(env, target);
  struct listener listener = {env, target, (*env)->GetMethodID(env, listener_type, "onChunk", "([B)Z")};
  int status = kiln_chat_completion(engine_of(handle), text, deliver, &listener);
  free(text);
  if (status != KILN_OK && !(*env)->ExceptionCheck(env)) throw_kiln(env, status, engine_of(handle));
}

JNIEXPORT void JNICALL Java_ai_kiln_KilnEngine_abort(JNIEnv* env, jclass type, jlong handle) {
  kiln_abort(engine_of(handle));
}

JNIEXPORT void JNICALL Java_ai_kiln_KilnEngine_reset(JNIEnv* env, jclass type, jlong handle) {
  int status = kiln_reset(engine_of(handle));
  if (status != KILN_OK) throw_kiln(env, status, engine_of(handle));
}

JNIEXPORT jbyteArray JNICALL Java_ai_kiln_KilnEngine_tokenize(JNIEnv* env, jclass type, jlong handle, jbyteArray text) {
  char* string = c_string(env, text);
  if (string == NULL) return NULL;
  const char* ids = kiln_tokenize(engine_of(handle), string);
  free(string);
  if (ids == NULL) {
    throw_kiln(env, -1, engine_of(handle));
    return NULL;
  }
  return java_bytes(env, ids);
}

JNIEXPORT void JNICALL Java_ai_kiln_KilnEngine_free(JNIEnv* env, jclass type, jlong handle) {
  kiln_engine_free(engine_of(handle));
}
