#include "pool.h"

#include <chrono>

namespace sd {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
}  // namespace

Pool::Pool(int threads, int spin_us) : n_(threads < 1 ? 1 : threads), spin_us_(spin_us) {
    // each worker starts from the generation before any region: a thread that first runs after the
    // first dispatch (its start can take milliseconds on a busy machine) must still see that region
    // as new, not take its generation as the one it has already seen
    const uint32_t start = generation_.load();
    for (int w = 1; w < n_; w++) threads_.emplace_back([this, w, start] { loop(w, start); });
}

Pool::~Pool() {
    stop_.store(true);
    generation_.fetch_add(1);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        wake_.notify_all();
    }
    for (auto& t : threads_) t.join();
}

void Pool::dispatch() {
    pending_.store(n_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {  // a worker that saw no new region is (or will be) waiting
        std::lock_guard<std::mutex> lock(mutex_);
        wake_.notify_all();
    }
    fn_(ctx_, 0, n_);
    // spin for the others; on a machine with other busy processes a worker may have lost its core,
    // and yielding hands it back instead of burning this one's timeslice
    for (int i = 1; pending_.load(std::memory_order_acquire) > 0; i++) {
        cpu_relax();
        if ((i & 1023) == 0) std::this_thread::yield();
    }
}

void Pool::loop(int w, uint32_t seen) {
    for (;;) {
        // wait for the next region: spin for spin_us, then sleep until dispatch() wakes us
        auto start = std::chrono::steady_clock::now();
        uint32_t now;
        for (int i = 0;; i++) {
            now = generation_.load(std::memory_order_acquire);
            if (now != seen) break;
            cpu_relax();
            if ((i & 1023) == 1023) std::this_thread::yield();
            if ((i & 255) == 255 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
                // sleeping_ is raised before the generation is read again (under the mutex), and
                // dispatch() raises the generation before reading sleeping_: one of the two sees the
                // other, so a region never starts unseen by a sleeping worker.
                std::unique_lock<std::mutex> lock(mutex_);
                sleeping_.fetch_add(1, std::memory_order_seq_cst);
                wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
                sleeping_.fetch_sub(1, std::memory_order_seq_cst);
                start = std::chrono::steady_clock::now();
            }
        }
        seen = now;
        if (stop_.load()) return;
        fn_(ctx_, w, n_);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

}  // namespace sd
