// Kiln's thread pool for the CPU wasm library: TVM's parallel loops on the page's Web Workers.
//
// TVM's CPU kernels hand each `parallel` loop to TVMBackendParallelLaunch; the web runtime answers
// with one task on the calling thread. Linked with --wrap, the launch lands here instead. Helpers
// are more instances of the same module on the same shared memory, each a Web Worker in
// kiln_threads_helper_loop; a launch publishes the job, wakes them and runs task 0 itself.
// Waiting spins on the word for a while, then sleeps in memory.atomic.wait32: a wake from the sleep
// takes long enough to cost SmolLM2's decode (some 120 launches a token) a quarter of its speed, and
// the next launch mostly comes within the spin; an endless spin would steal a busy machine's cores.
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

extern "C" {

typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

void __set_thread_state(void* thread, int is_main, int is_runtime, int can_block);
void __wasm_init_tls(void* block);

int __real_TVMBackendParallelLaunch(FTVMParallelLambda flambda, void* cdata, int num_task);
void* __real_TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes, int dtype_code, int dtype_bits);
int __real_TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr);

#define KILN_MAX_HELPERS 15
#define KILN_STACK_BYTES (1 << 20)
// A helper's workspaces: SmolLM2's kernels ask for 9-24 KB a task.
#define KILN_ARENA_BYTES (4 << 20)
#define KILN_WORKSPACE_ALIGN 64
// Polls before sleeping, a few hundred microseconds. SmolLM2 decode, 2 threads in Chromium:
// 19.2 tokens/s with none, 25.0 with 1 << 18, 24.7 with 1 << 20.
#define KILN_SPIN (1 << 18)

typedef struct {
  uintptr_t stack_low, stack_high;  // the helper's stack, which also tells a helper who it is
  uintptr_t arena, arena_used;
  void* tls;  // the helper's thread-local variables (one instance's are not another's)
  int32_t seen;  // the last job generation the helper has looked at
} Helper;

static struct {
  int32_t reserved;    // helpers given a stack and an arena
  int32_t helpers;     // helpers that entered the pool
  int32_t generation;  // bumped for every job: the word helpers sleep on
  int32_t pending;     // helper tasks of the current job still running: the word the caller sleeps on
  int32_t stop;
  int32_t running;     // a job is out: a launch from inside a task runs inline
  int32_t failed;
  int32_t barrier_count, barrier_generation;
  FTVMParallelLambda lambda;
  void* cdata;
  int32_t num_task;
  Helper helper[KILN_MAX_HELPERS];
} pool;

static int32_t load(int32_t* word) { return __atomic_load_n(word, __ATOMIC_SEQ_CST); }
static void store(int32_t* word, int32_t value) { __atomic_store_n(word, value, __ATOMIC_SEQ_CST); }
static void wait_while_equal(int32_t* word, int32_t value) {
  for (int spin = 0; spin < KILN_SPIN; ++spin)
    if (load(word) != value) return;
  while (load(word) == value) __builtin_wasm_memory_atomic_wait32(word, value, -1);
}
static void wake_all(int32_t* word) { __builtin_wasm_memory_atomic_notify(word, (uint32_t)-1); }

// Which helper runs this code (-1: the thread that owns the VM), told by the stack it runs on.
static int current_helper(void) {
  uintptr_t here = (uintptr_t)__builtin_frame_address(0);
  for (int i = 0; i < pool.reserved; ++i)
    if (here >= pool.helper[i].stack_low && here < pool.helper[i].stack_high) return i;
  return -1;
}

static void run_task(int task_id) {
  TVMParallelGroupEnv env = {NULL, pool.num_task};
  if (pool.lambda(task_id, &env, pool.cdata) != 0) store(&pool.failed, 1);
}

static size_t round_up(size_t size, size_t alignment) { return (size + alignment - 1) & ~(alignment - 1); }

// aligned_alloc wants a size that is a multiple of the alignment (and, to succeed, not 0).
static void* allocate(size_t alignment, size_t size) {
  return aligned_alloc(alignment, round_up(size > 0 ? size : 1, alignment));
}

static void* new_tls_block(void) { return allocate(__builtin_wasm_tls_align(), __builtin_wasm_tls_size()); }

// What emscripten's JS glue does for the main thread (the library runs without that glue): the
// engine forwards the import __emscripten_init_main_thread_js, called by the constructors, here.
void kiln_threads_adopt_main_thread(void* thread) {
  __wasm_init_tls(new_tls_block());
  __set_thread_state(thread, 1, 1, 1);
}

// Memory for `count` helpers' stacks and arenas; returns the stack tops (the JS side starts the
// Workers with them) or NULL. Called once, by the thread that owns the VM, before any helper runs.
uintptr_t* kiln_threads_reserve(int count) {
  static uintptr_t stack_tops[KILN_MAX_HELPERS];
  if (count < 1 || count > KILN_MAX_HELPERS || pool.reserved != 0) return NULL;
  for (int i = 0; i < count; ++i) {
    char* stack = static_cast<char*>(allocate(16, KILN_STACK_BYTES));
    char* arena = static_cast<char*>(allocate(KILN_WORKSPACE_ALIGN, KILN_ARENA_BYTES));
    void* tls = new_tls_block();
    if (stack == NULL || arena == NULL || tls == NULL) return NULL;
    pool.helper[i] = Helper{(uintptr_t)stack, (uintptr_t)stack + KILN_STACK_BYTES, (uintptr_t)arena, 0, tls, 0};
    stack_tops[i] = (uintptr_t)stack + KILN_STACK_BYTES;
  }
  pool.reserved = count;
  return stack_tops;
}

// A helper Worker joins the pool in two calls: enter, which counts it in (jobs from then on are its
// to run), then, once the Worker has said so to the engine, the loop, which returns on stop.
void kiln_threads_helper_enter(int index) {
  __wasm_init_tls(pool.helper[index].tls);
  pool.helper[index].seen = load(&pool.generation);
  __atomic_fetch_add(&pool.helpers, 1, __ATOMIC_SEQ_CST);
}

void kiln_threads_helper_loop(int index) {
  Helper* helper = &pool.helper[index];
  for (;;) {
    wait_while_equal(&pool.generation, helper->seen);
    helper->seen = load(&pool.generation);
    if (load(&pool.stop)) return;
    if (index + 1 < pool.num_task) {
      helper->arena_used = 0;
      run_task(index + 1);
      if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_SEQ_CST) == 0) wake_all(&pool.pending);
    }
  }
}

void kiln_threads_stop(void) {
  store(&pool.stop, 1);
  __atomic_fetch_add(&pool.generation, 1, __ATOMIC_SEQ_CST);
  wake_all(&pool.generation);
}

// The threads parallel loops run on: 1 until every helper is in its loop, and after a stop.
int kiln_threads_count(void) {
  return !load(&pool.stop) && load(&pool.helpers) == pool.reserved ? pool.reserved + 1 : 1;
}

int __wrap_TVMBackendParallelLaunch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  // Until every helper is in its loop the jobs run inline: a helper not yet waiting would miss one.
  int threads = kiln_threads_count();
  if (num_task <= 0 || num_task > threads) num_task = threads;
  if (num_task == 1 || load(&pool.running)) {
    return __real_TVMBackendParallelLaunch(flambda, cdata, num_task);
  }
  store(&pool.running, 1);
  pool.lambda = flambda;
  pool.cdata = cdata;
  pool.num_task = num_task;
  pool.failed = 0;
  store(&pool.pending, num_task - 1);
  __atomic_fetch_add(&pool.generation, 1, __ATOMIC_SEQ_CST);
  wake_all(&pool.generation);
  run_task(0);
  for (int32_t left = load(&pool.pending); left != 0; left = load(&pool.pending)) wait_while_equal(&pool.pending, left);
  store(&pool.running, 0);
  return load(&pool.failed) ? -1 : 0;
}

int __wrap_TVMBackendParallelBarrier(int task_id, TVMParallelGroupEnv* penv) {
  (void)task_id;
  int32_t generation = load(&pool.barrier_generation);
  if (__atomic_add_fetch(&pool.barrier_count, 1, __ATOMIC_SEQ_CST) == penv->num_task) {
    store(&pool.barrier_count, 0);
    __atomic_fetch_add(&pool.barrier_generation, 1, __ATOMIC_SEQ_CST);
    wake_all(&pool.barrier_generation);
  } else {
    wait_while_equal(&pool.barrier_generation, generation);
  }
  return 0;
}

// The runtime's workspace pool is not thread-safe: a helper bumps through its own arena instead,
// emptied at each task's start (workspaces live within one task). A workspace the arena cannot hold
// (a real-sized model's prefill asks for more than SmolLM2's) comes from the heap, whose allocator
// is the thread-safe one, and goes back to it when the kernel frees it.
static bool in_arena(const Helper* helper, void* ptr) {
  return (uintptr_t)ptr >= helper->arena && (uintptr_t)ptr < helper->arena + KILN_ARENA_BYTES;
}

void* __wrap_TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes, int dtype_code,
                                      int dtype_bits) {
  int index = current_helper();
  if (index < 0) return __real_TVMBackendAllocWorkspace(device_type, device_id, nbytes, dtype_code, dtype_bits);
  Helper* helper = &pool.helper[index];
  uintptr_t size = round_up(nbytes, KILN_WORKSPACE_ALIGN);
  if (helper->arena_used + size > KILN_ARENA_BYTES) {
    return allocate(KILN_WORKSPACE_ALIGN, size);  // NULL, out of memory: the kernel reports it
  }
  void* workspace = (void*)(helper->arena + helper->arena_used);
  helper->arena_used += size;
  return workspace;
}

int __wrap_TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr) {
  int index = current_helper();
  if (index < 0) return __real_TVMBackendFreeWorkspace(device_type, device_id, ptr);
  if (!in_arena(&pool.helper[index], ptr)) free(ptr);
  return 0;
}

}  // extern "C"
