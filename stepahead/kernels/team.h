// Team: the threads of one OpenMP parallel region working through a computation phase by phase.
//
// With passive OpenMP waiting (the worker's default, see executor/spawn.py) entering a parallel region
// wakes a sleeping thread, tens of microseconds, and a one-token decode step entered about 150
// regions: a large share of its time. A Team enters one region for a whole step. A phase's items (a
// projection's column blocks, the attention's tasks, ...) are handed out through a shared counter to
// whichever member asks first, and a phase starts once every item of the phases before it is complete:
// there is no barrier that waits for every member, so a member that lost its core to another process
// holds up only the items it took, and the others do the rest. Waiting spins (the next phase is
// microseconds away), then yields the core. Which thread computes an item never changes its result.

#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

namespace stepahead_cpu {

class Team {
 public:
  // One thread's place in the team: how many items all phases so far have handed out.
  class Member {
   public:
    Member(Team& team, int index, int members) : team_(team), index_(index), members_(members) {}

    // The thread that entered the region: the one to call torch's operators (its thread-local state,
    // inference mode included, is the caller's).
    bool leader() const { return index_ == 0; }
    // Which member this is, 0 .. members() - 1 (the leader is 0).
    int index() const { return index_; }
    int members() const { return members_; }

    // A phase of n items: f(i) for every i in [0, n), `chunk` items at a time to whichever member
    // asks first. Every member makes the same calls with the same n, in the same order.
    template <class F>
    void share(int64_t n, int64_t chunk, F&& f) {
      team_.wait_for(base_);  // the earlier phases' outputs are this one's inputs
      const int64_t end = base_ + n;
      int64_t next = team_.claimed_.load(std::memory_order_relaxed);
      while (next < end) {
        const int64_t stop = std::min(next + chunk, end);
        if (team_.claimed_.compare_exchange_weak(next, stop, std::memory_order_relaxed)) {
          for (int64_t i = next; i < stop; ++i) f(i - base_);
          team_.done_.fetch_add(stop - next, std::memory_order_release);
          next = stop;
        }
      }
      base_ = end;
    }

    // A phase of one item only the leader computes.
    template <class F>
    void leader_runs(F&& f) {
      if (leader()) {
        team_.wait_for(base_);
        f();
        team_.claimed_.fetch_add(1, std::memory_order_relaxed);
        team_.done_.fetch_add(1, std::memory_order_release);
      }
      base_ += 1;
    }

   private:
    Team& team_;
    int index_;
    int members_;
    int64_t base_ = 0;
  };

 private:
  // About 30 µs of pause instructions (30 ns each on the build machine's Zen 3): longer than most
  // phases, far shorter than a scheduler tick.
  static constexpr int kSpinsBeforeYield = 1 << 10;

  // Until `items` items are complete.
  void wait_for(int64_t items) const {
    for (int spins = 0; done_.load(std::memory_order_acquire) < items; ++spins) {
      if (spins < kSpinsBeforeYield) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

  alignas(64) std::atomic<int64_t> claimed_{0};  // items handed out, over all phases
  alignas(64) std::atomic<int64_t> done_{0};     // items complete
};

// body(member) on `threads` threads of one parallel region (on the calling thread alone where one
// thread is asked for, or where the caller already runs in a parallel region). The region's end waits
// for every member, so every item is complete when this returns. body must not throw.
template <class F>
void run_in_team(int threads, F&& body) {
  Team team;
  if (threads <= 1 || omp_in_parallel()) {
    Team::Member member(team, 0, 1);
    body(member);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    Team::Member member(team, omp_get_thread_num(), omp_get_num_threads());
    body(member);
  }
}

// An item count per claim that keeps the shared counter's traffic small against the work: about
// eight claims per member.
inline int64_t claim_size(int64_t items, int members) {
  return std::max<int64_t>(1, items / (8 * static_cast<int64_t>(members)));
}

}  // namespace stepahead_cpu
