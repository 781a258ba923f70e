// A fixed pool of threads for the parallel parts of a pass. The calling thread is worker 0, so
// `threads` = the machine's cores uses every core. Between the ~150 parallel regions of a pass
// the workers spin (a region starts within a microsecond); after `spin_us` without work they
// sleep on a condition variable, so an idle engine (a server between requests) costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace sd {

class Pool {
public:
    explicit Pool(int threads, int spin_us = 2000);
    ~Pool();
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;

    int size() const { return n_; }

    // f(worker, n_workers) on every worker, returning when all are done.
    template <class Fn>
    void run(Fn&& f) {
        if (n_ == 1) {
            f(0, 1);
            return;
        }
        fn_ = [](void* ctx, int w, int n) { (*static_cast<std::remove_reference_t<Fn>*>(ctx))(w, n); };
        ctx_ = &f;
        dispatch();
    }

    // [begin, end) of worker w's share of n items in equal contiguous parts.
    static void share(int64_t n, int w, int workers, int64_t* begin, int64_t* end) {
        *begin = n * w / workers;
        *end = n * (w + 1) / workers;
    }

private:
    void dispatch();
    void loop(int w, uint32_t seen);

    int n_;
    int spin_us_;
    std::vector<std::thread> threads_;
    std::atomic<uint32_t> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<int> sleeping_{0};
    std::atomic<bool> stop_{false};
    std::mutex mutex_;  // with wake_: a worker's sleep between regions
    std::condition_variable wake_;
    void (*fn_)(void*, int, int) = nullptr;
    void* ctx_ = nullptr;
};

}  // namespace sd
