// Tensor-parallel ranks on one host meet through flags in shared memory (kernels/shm_comm.py):
// a gloo round trip costs a millisecond on a small host, this a few microseconds.
#include <sched.h>

#include <chrono>

#include "kernels.h"


namespace fusedserve {

// flags: int64 [size * 8] in shared memory, rank r's flag at 8 r (a cache line each). Publishes
// this rank's ``seq`` (release: its earlier writes to the shared buffers are visible to a rank
// that sees it), then waits until every flag reaches ``seq`` (acquire). Returns false if that
// took longer than ``wait_us`` (the caller checks its peers are alive and calls again).
bool group_arrive_wait(at::Tensor flags, int64_t rank, int64_t seq, int64_t wait_us) {
  TORCH_CHECK(flags.scalar_type() == at::kLong && flags.is_contiguous() && flags.numel() % 8 == 0,
              "group_arrive_wait: flags int64 [size * 8]");
  int64_t* f = flags.data_ptr<int64_t>();
  const int64_t size = flags.numel() / 8;
  __atomic_store_n(f + 8 * rank, seq, __ATOMIC_RELEASE);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(wait_us);
  for (int64_t j = 0; j < size; ++j) {
    int spins = 0;
    while (__atomic_load_n(f + 8 * j, __ATOMIC_ACQUIRE) < seq) {
      if (++spins < 2048) {
        _mm_pause();
        continue;
      }
      spins = 0;
      if (std::chrono::steady_clock::now() > deadline) return false;
      sched_yield();  // a rank sharing this core gets it
    }
  }
  return true;
}

}  // namespace fusedserve
