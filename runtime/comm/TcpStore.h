//===- TcpStore.h - a key-value store for rendezvous over TCP --*- C++ -*-===//
//
// Gloo (Debian's 2022 snapshot) ships file and Redis stores only. Jobs
// started by torchrun / mpirun / srun across machines meet through
// MASTER_ADDR:MASTER_PORT instead: rank 0 serves this store there, every
// rank (rank 0 included) is a client. The protocol is tiny: SET key value,
// GET key (absent or the value); waits poll with a bounded timeout.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_COMM_TCPSTORE_H
#define FSDP_RUNTIME_COMM_TCPSTORE_H

#include "runtime/core/Status.h"

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

namespace fsdp {

class TcpStore : public gloo::rendezvous::Store {
public:
  /// Connects to host:port, starting the server there first when `serve`.
  /// Throws std::runtime_error with a message naming what failed (Gloo's
  /// rendezvous is exception-based; the caller turns it into a Status).
  TcpStore(const std::string &host, int port, bool serve,
           std::chrono::milliseconds timeout);
  ~TcpStore() override;

  void set(const std::string &key, const std::vector<char> &data) override;
  std::vector<char> get(const std::string &key) override;
  void wait(const std::vector<std::string> &keys) override;
  void wait(const std::vector<std::string> &keys,
            const std::chrono::milliseconds &timeout) override;

  /// Returns false when `key` is absent, without waiting.
  bool tryGet(const std::string &key, std::vector<char> &out);

  /// Bounds every later request: a server that does not answer within
  /// `t` (rank 0 stopped, say) makes the request throw instead of blocking,
  /// and the connection is not used again. Used by the flight recorder,
  /// which must never hang on the store it reports through.
  void setIoTimeout(std::chrono::milliseconds t);

private:
  int fd = -1;
  bool broken = false;
  std::mutex mu;
  std::chrono::milliseconds timeout;
};

} // namespace fsdp

#endif // FSDP_RUNTIME_COMM_TCPSTORE_H
