//===- HostWorker.h - a stream run by one host thread ----------*- C++ -*-===//
//
// A thread working through a queue of jobs in order: the CPU device's comm
// stream and both devices' host stream ([Note: streams and events] in
// Device.h). A job that runs stream work checks and updates `sticky`
// itself (work after a failure is skipped); a marker job records the
// status so far for the thread that waits on it.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_HOSTWORKER_H
#define FSDP_RUNTIME_CORE_HOSTWORKER_H

#include "runtime/core/Status.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace fsdp {

class HostWorker {
public:
  /// `init` runs first on the thread (per-thread settings: OpenMP's
  /// thread count, the CUDA device).
  explicit HostWorker(std::function<void()> init = nullptr)
      : init(std::move(init)), thread([this] { loop(); }) {}
  /// Joins once the queued jobs have run.
  ~HostWorker() {
    {
      std::lock_guard<std::mutex> l(mu);
      stopping = true;
    }
    cv.notify_all();
    thread.join();
  }
  HostWorker(const HostWorker &) = delete;
  HostWorker &operator=(const HostWorker &) = delete;

  void push(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> l(mu);
      jobs.push_back(std::move(job));
    }
    cv.notify_one();
  }
  /// Enqueues `work` as stream work: skipped after a failure, its own
  /// failure sticky.
  void pushWork(std::function<Status()> work) {
    push([this, work = std::move(work)] {
      if (sticky)
        sticky = work();
    });
  }
  /// A marker: ready, with the stream's status so far, once the jobs
  /// queued before it have run.
  std::shared_future<Status> marker() {
    auto p = std::make_shared<std::promise<Status>>();
    std::shared_future<Status> f = p->get_future().share();
    push([this, p] { p->set_value(sticky); });
    return f;
  }
  /// Waits for the jobs queued so far; the stream's first failure, which
  /// is then cleared (the stream runs work again).
  Status drain() {
    Status st = marker().get();
    // The queue is empty up to the marker and only the caller pushes.
    sticky = Status::ok();
    return st;
  }

  /// The stream's first failure (the worker thread only, or after a
  /// marker with nothing queued behind it).
  Status sticky;

private:
  void loop() {
    if (init)
      init();
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return stopping || !jobs.empty(); });
        if (jobs.empty())
          return;
        job = std::move(jobs.front());
        jobs.pop_front();
      }
      job();
    }
  }
  std::function<void()> init;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> jobs;
  bool stopping = false;
  std::thread thread; // last: starts after the members it uses
};

} // namespace fsdp

#endif // FSDP_RUNTIME_CORE_HOSTWORKER_H
