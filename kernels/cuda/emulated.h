// CUDA built-ins for g++ (C++20): the `cuda-emulated` backend runs mpicomp's .cu sources on the
// CPU with this header force-included (kernels/cuda/emulated.py builds and calls them).
//
// Model: each CUDA thread of a block is a std::thread; blocks run one after another, so a
// `__shared__` variable is a function-local `static` (one copy, reused block after block, as
// shared memory is). Barriers (__syncthreads*, __syncwarp, warp shuffles, votes, reductions)
// meet under one mutex per block. A barrier that cannot complete (reached by part of a block
// or warp, or at two different source lines) fails the launch with a message naming the kernel,
// the block, the thread and the line, instead of hanging or being silently wrong; the waiting
// threads unwind and Python raises. Atomics go through std::atomic_ref on the caller's memory.
//
// Not emulated (docs/kernels.md says so): ordering between blocks (they never run at once here),
// the GPU memory model beyond what the barriers order, occupancy and speed.
#pragma once
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <memory>
#include <mutex>
#include <semaphore>
#include <source_location>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#define MPICOMP_EMULATED 1
#define __CUDA_ARCH__ 900  // the #if paths of the sm_90 build
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict
#define __shared__ static  // blocks run one after another: one static copy is the block's
#define __constant__ static const

struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;
constexpr int warpSize = 32;

namespace emu {

// Thrown in every thread of a block whose launch failed; caught where the thread starts.
struct Abort {};

struct Group {  // one barrier: the block's, or a warp's for one mask
  std::condition_variable cv;
  unsigned arrived = 0;
  unsigned long long gen = 0, acc = 0, res = 0;
  const char* file = nullptr;  // where the first thread of this round arrived
  unsigned line = 0;
};

struct Block {
  const char* kernel = "";
  std::mutex m;
  std::unordered_map<uint64_t, Group> groups;  // key: kBlockKey, or warp << 32 | mask
  std::vector<uint32_t> live, lanes;           // live lanes, and lanes that exist, per warp
  unsigned live_threads = 0, nthreads = 0;
  std::vector<std::array<uint64_t, 32>> slot;  // shuffle exchange, per warp
  std::vector<unsigned char> dyn_smem;
  int timeout_s = 10;
  bool failed = false;
  std::string error;
};

inline thread_local Block* cur = nullptr;
inline thread_local unsigned lane_ = 0, warp_ = 0;
constexpr uint64_t kBlockKey = ~0ull;

// Record the first failure of the launch, wake every waiting thread, unwind this one.
// Called with the block's mutex held.
[[noreturn]] inline void fail(const std::string& what, const std::source_location& at) {
  if (!cur->failed) {
    char where[256];
    std::snprintf(where, sizeof where, " (kernel %s, block %u,%u,%u, thread %u,%u,%u, %s:%u)",
                  cur->kernel, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y,
                  threadIdx.z, at.file_name(), unsigned(at.line()));
    cur->failed = true;
    cur->error = what + where;
  }
  for (auto& [key, g] : cur->groups) g.cv.notify_all();
  throw Abort{};
}

inline unsigned expected(uint64_t key) {
  if (key == kBlockKey) return cur->live_threads;
  return std::popcount(uint32_t(key) & cur->live[key >> 32]);
}

inline void release(Group& g) {
  g.res = g.acc;
  g.arrived = 0;
  g.file = nullptr;
  ++g.gen;
  g.cv.notify_all();
}

// Arrive at barrier `key` with value v; return the reduction of the values (op 0: sum,
// 1: or, 2: and) over the threads that meet there.
inline unsigned long long arrive(uint64_t key, unsigned long long v, int op,
                                 const std::source_location& at) {
  std::unique_lock lk(cur->m);
  if (cur->failed) throw Abort{};
  const bool block = key == kBlockKey;
  if (block && cur->live_threads != cur->nthreads)
    fail("__syncthreads reached after other threads of the block exited (divergent barrier)", at);
  if (!block && (uint32_t(key) & ~cur->live[key >> 32] & cur->lanes[key >> 32]))
    fail("a warp *_sync mask names a lane that already exited (divergent barrier)", at);
  Group& g = cur->groups[key];
  if (g.arrived == 0) {
    g.acc = op == 2 ? ~0ull : 0;
    g.file = at.file_name();
    g.line = at.line();
  } else if (g.line != at.line() || std::strcmp(g.file, at.file_name()) != 0) {
    fail(std::string(block ? "__syncthreads" : "a warp *_sync") + " reached at two places: line " +
             std::to_string(g.line) + " and this one (divergent barrier)",
         at);
  }
  g.acc = op == 0 ? g.acc + v : op == 1 ? (g.acc | v) : (g.acc & v);
  const unsigned long long round = g.gen;
  if (++g.arrived >= expected(key)) {
    release(g);
    return g.res;
  }
  // Yield a while first: the threads still to arrive need this core more than a sleeper
  // needs a wake-up (a condition variable hand-off costs a context switch per thread).
  for (int spin = 0; spin < 64; ++spin) {
    lk.unlock();
    std::this_thread::yield();
    lk.lock();
    if (g.gen != round || cur->failed) break;
  }
  const bool done = g.cv.wait_for(lk, std::chrono::seconds(cur->timeout_s),
                                  [&] { return g.gen != round || cur->failed; });
  if (cur->failed) throw Abort{};
  if (!done)
    fail(block ? "__syncthreads never completed (some threads wait elsewhere)"
               : "a warp *_sync never completed (mask or divergence)",
         at);
  return g.res;
}

// A thread leaves the kernel: it no longer counts toward barriers (as on sm_70 and later),
// but one that others already wait for with it is a divergent barrier.
inline void leave() {
  std::lock_guard lk(cur->m);
  if (cur->failed) return;
  for (auto& [key, g] : cur->groups) {
    const bool mine = key == kBlockKey || ((key >> 32) == warp_ && (key >> lane_ & 1u));
    if (g.arrived && mine) {
      cur->failed = true;
      char msg[256];
      std::snprintf(msg, sizeof msg,
                    "thread %u,%u,%u exited while others wait for it in %s at line %u "
                    "(divergent barrier; kernel %s, block %u,%u,%u)",
                    threadIdx.x, threadIdx.y, threadIdx.z,
                    key == kBlockKey ? "__syncthreads" : "a warp *_sync", g.line, cur->kernel,
                    blockIdx.x, blockIdx.y, blockIdx.z);
      cur->error = msg;
      for (auto& [k, h] : cur->groups) h.cv.notify_all();
      return;
    }
  }
  cur->live[warp_] &= ~(1u << lane_);
  --cur->live_threads;
  for (auto& [key, g] : cur->groups)
    if (g.arrived && g.arrived >= expected(key)) release(g);
}

inline uint64_t warp_key(unsigned mask, const std::source_location& at) {
  if (!(mask >> lane_ & 1u)) {
    std::lock_guard lk(cur->m);
    fail("a *_sync mask excludes the calling lane", at);
  }
  return (uint64_t(warp_) << 32) | mask;
}

template <class T>
inline T shfl_from(unsigned mask, T v, int src, const std::source_location& at) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  const uint64_t key = warp_key(mask, at);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  cur->slot[warp_][lane_] = bits;
  arrive(key, 0, 0, at);  // every lane has written its value
  if (!(mask >> src & 1u)) {
    std::lock_guard lk(cur->m);
    fail("__shfl_*_sync reads a lane outside its mask (undefined on a GPU)", at);
  }
  bits = cur->slot[warp_][src];
  arrive(key, 0, 0, at);  // every lane has read before the slots are reused
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

inline unsigned char* dyn_smem() { return cur->dyn_smem.data(); }

template <class... A, size_t... I>
void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cvref_t<A>*>(args[I])...);
}

// The CUDA threads of a block run on pooled std::threads, kept between launches: creating
// a thousand threads per block would cost more than most kernels. Never joined (detached):
// they idle on a condition variable until the process exits.
struct Pool {
  struct Worker {
    std::binary_semaphore go{0};
  };
  std::vector<std::unique_ptr<Worker>> workers;
  std::counting_semaphore<> done{0};
  void (*task)(void*, unsigned) = nullptr;
  void* ctx = nullptr;

  // Run f(c, t) for t in [0, n) on n pooled threads; wake only those n.
  void run(unsigned n, void (*f)(void*, unsigned), void* c) {
    while (workers.size() < n) {
      workers.push_back(std::make_unique<Worker>());
      Worker* w = workers.back().get();
      const unsigned id = unsigned(workers.size() - 1);
      std::thread([this, w, id] { work(*w, id); }).detach();
    }
    task = f;
    ctx = c;
    for (unsigned t = 0; t < n; ++t) workers[t]->go.release();
    for (unsigned t = 0; t < n; ++t) done.acquire();
  }

  void work(Worker& w, unsigned id) {
    for (;;) {
      w.go.acquire();  // the semaphore orders task/ctx before their use
      task(ctx, id);
      done.release();
    }
  }
};

inline Pool& pool() {
  static Pool* p = new Pool;  // leaked on purpose: its threads outlive static destructors
  return *p;
}

template <class... A> struct LaunchState {
  void (*f)(A...);
  void** args;
  Block* block;
  dim3 grid, dim;
  uint3 index;
  bool ftz;
};

template <class... A> void run_one(void* p, unsigned t) {
  auto& s = *static_cast<LaunchState<A...>*>(p);
  cur = s.block;
  lane_ = t % 32;
  warp_ = t / 32;
#if defined(__x86_64__)
  // CuPy always compiles with -ftz=true: float32 denormals flush to zero.
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(s.ftz ? csr | 0x8040 : csr & ~0x8040u);
#endif
  threadIdx = {t % s.dim.x, (t / s.dim.x) % s.dim.y, t / (s.dim.x * s.dim.y)};
  blockIdx = s.index;
  blockDim = s.dim;
  gridDim = s.grid;
  try {
    call(s.f, s.args, std::index_sequence_for<A...>{});
    leave();
  } catch (const Abort&) {
  }
}

// Launch f over grid x block, blocks one after another: float32 denormals flushed when
// `ftz`, a barrier failed after `timeout_s` seconds (the loader reads both from the
// environment). Returns 0, or writes why the launch failed into `error` (size `cap`) and
// returns 1.
template <class... A>
int launch(const char* name, void (*f)(A...), dim3 grid, dim3 block, size_t smem, void** args,
           bool ftz, int timeout_s, char* error, size_t cap) {
  const unsigned nt = block.x * block.y * block.z, nw = (nt + 31) / 32;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block B;
        B.kernel = name;
        B.live.assign(nw, 0);
        B.slot.resize(nw);
        B.dyn_smem.assign(smem ? smem : 1, 0xA5);  // poisoned: a GPU's is uninitialized
        B.live_threads = B.nthreads = nt;
        B.timeout_s = timeout_s;
        for (unsigned t = 0; t < nt; ++t) B.live[t / 32] |= 1u << (t % 32);
        B.lanes = B.live;
        LaunchState<A...> state{f, args, &B, grid, block, {bx, by, bz}, ftz};
        pool().run(nt, &run_one<A...>, &state);
        if (B.failed) {
          std::snprintf(error, cap, "%s", B.error.c_str());
          return 1;
        }
      }
  return 0;
}

template <class... A> constexpr int nargs(void (*)(A...)) { return sizeof...(A); }
template <class... A> constexpr size_t argsize(void (*)(A...), int i) {
  size_t s[] = {sizeof(A)..., 0};
  return s[i];
}
template <class T> constexpr char kind_of() {
  return std::is_pointer_v<T> ? 'p' : std::is_floating_point_v<T> ? 'f' : 'i';
}
template <class... A> constexpr char argkind(void (*)(A...), int i) {
  char k[] = {kind_of<std::remove_cvref_t<A>>()..., 0};
  return k[i];
}
}  // namespace emu

// What the loader appends for each kernel: a launch entry and its parameter list.
#define MPICOMP_EMULATED_EXPORT(k)                                                              \
  extern "C" int emu_launch_##k(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, \
                                unsigned bz, size_t smem, void** args, int ftz, int timeout_s,   \
                                char* err, size_t cap) {                                         \
    return emu::launch(#k, &k, {gx, gy, gz}, {bx, by, bz}, smem, args, ftz != 0, timeout_s, err, \
                       cap);                                                                    \
  }                                                                                             \
  extern "C" int emu_nargs_##k() { return emu::nargs(&k); }                                     \
  extern "C" size_t emu_argsize_##k(int i) { return emu::argsize(&k, i); }                      \
  extern "C" char emu_argkind_##k(int i) { return emu::argkind(&k, i); }

#define EMU_AT std::source_location at = std::source_location::current()

// ---- barriers, votes, shuffles -------------------------------------------------------------
inline void __syncthreads(EMU_AT) { emu::arrive(emu::kBlockKey, 0, 0, at); }
inline int __syncthreads_count(int p, EMU_AT) { return int(emu::arrive(emu::kBlockKey, p != 0, 0, at)); }
inline int __syncthreads_or(int p, EMU_AT) { return emu::arrive(emu::kBlockKey, p != 0, 1, at) != 0; }
inline int __syncthreads_and(int p, EMU_AT) { return emu::arrive(emu::kBlockKey, p != 0, 2, at) != 0; }
inline void __syncwarp(unsigned mask = 0xffffffffu, EMU_AT) { emu::arrive(emu::warp_key(mask, at), 0, 0, at); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned __ballot_sync(unsigned m, int p, EMU_AT) {
  return unsigned(emu::arrive(emu::warp_key(m, at), p ? 1ull << emu::lane_ : 0, 1, at));
}
inline int __any_sync(unsigned m, int p, EMU_AT) { return __ballot_sync(m, p, at) != 0; }
inline int __all_sync(unsigned m, int p, EMU_AT) {
  const unsigned want = m & emu::cur->live[emu::warp_];
  return (__ballot_sync(m, p, at) & want) == want;
}
template <class T> T __shfl_sync(unsigned m, T v, int src, int w = 32, EMU_AT) {
  return emu::shfl_from(m, v, int(emu::lane_ & ~unsigned(w - 1)) + (src & (w - 1)), at);
}
template <class T> T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32, EMU_AT) {
  const int l = int(emu::lane_ & unsigned(w - 1));
  return emu::shfl_from(m, v, l - int(d) >= 0 ? int(emu::lane_) - int(d) : int(emu::lane_), at);
}
template <class T> T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32, EMU_AT) {
  const int l = int(emu::lane_ & unsigned(w - 1));
  return emu::shfl_from(m, v, l + int(d) < w ? int(emu::lane_) + int(d) : int(emu::lane_), at);
}
template <class T> T __shfl_xor_sync(unsigned m, T v, int x, int w = 32, EMU_AT) {
  const int l = int(emu::lane_ & unsigned(w - 1)), t = l ^ x;
  return emu::shfl_from(m, v, t < w ? int(emu::lane_) - l + t : int(emu::lane_), at);
}
inline unsigned __reduce_add_sync(unsigned m, unsigned v, EMU_AT) {
  return unsigned(emu::arrive(emu::warp_key(m, at), v, 0, at));
}
inline unsigned __reduce_or_sync(unsigned m, unsigned v, EMU_AT) {
  return unsigned(emu::arrive(emu::warp_key(m, at), v, 1, at));
}
inline unsigned __reduce_and_sync(unsigned m, unsigned v, EMU_AT) {
  return unsigned(emu::arrive(emu::warp_key(m, at), v, 2, at));
}

// ---- atomics: std::atomic_ref on the caller's memory -----------------------------------------
template <class T, class U> T atomicAdd(T* a, U v) { return std::atomic_ref<T>(*a).fetch_add(T(v)); }
template <class T, class U> T atomicSub(T* a, U v) { return std::atomic_ref<T>(*a).fetch_sub(T(v)); }
template <class T, class U> T atomicOr(T* a, U v) { return std::atomic_ref<T>(*a).fetch_or(T(v)); }
template <class T, class U> T atomicAnd(T* a, U v) { return std::atomic_ref<T>(*a).fetch_and(T(v)); }
template <class T, class U> T atomicXor(T* a, U v) { return std::atomic_ref<T>(*a).fetch_xor(T(v)); }
template <class T, class U> T atomicExch(T* a, U v) { return std::atomic_ref<T>(*a).exchange(T(v)); }
template <class T, class U> T atomicCAS(T* a, U c, U v) {
  T e = T(c);
  std::atomic_ref<T>(*a).compare_exchange_strong(e, T(v));
  return e;
}
template <class T, class U> T atomicMax(T* a, U v) {
  std::atomic_ref<T> r(*a);
  T o = r.load();
  while (o < T(v) && !r.compare_exchange_weak(o, T(v))) {
  }
  return o;
}
template <class T, class U> T atomicMin(T* a, U v) {
  std::atomic_ref<T> r(*a);
  T o = r.load();
  while (T(v) < o && !r.compare_exchange_weak(o, T(v))) {
  }
  return o;
}

// ---- integer and float intrinsics ------------------------------------------------------------
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(unsigned(x)); }
inline int __clzll(long long x) { return std::countl_zero((unsigned long long)x); }
inline int __ffs(int x) { return x ? std::countr_zero(unsigned(x)) + 1 : 0; }
inline int __ffsll(long long x) { return x ? std::countr_zero((unsigned long long)x) + 1 : 0; }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
  return (unsigned long long)__brev(unsigned(x)) << 32 | __brev(unsigned(x >> 32));
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((unsigned long long)a * b >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)((unsigned __int128)a * b >> 64);
}
// PTX's funnel shifts clamp (or wrap) the shift to 0..31; C++ shifts by 32 are undefined.
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  s &= 31u;
  return s ? (hi << s) | (lo >> (32u - s)) : hi;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  s &= 31u;
  return s ? (lo >> s) | (hi << (32u - s)) : lo;
}
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline int __float2int_rn(float x) { return int(std::nearbyint(x)); }  // round to nearest even
inline int __float2int_rd(float x) { return int(std::floor(x)); }
inline int __float2int_ru(float x) { return int(std::ceil(x)); }
inline int __float2int_rz(float x) { return int(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : x > 1.f ? 1.f : x; }
template <class T> T __ldg(const T* p) { return *p; }
template <class A, class B> auto min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(a) : C(b);
}
template <class A, class B> auto max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}
