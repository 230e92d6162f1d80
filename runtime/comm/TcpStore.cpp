//===- TcpStore.cpp - a key-value store for rendezvous over TCP -----------===//

#include "runtime/comm/TcpStore.h"

#include <arpa/inet.h>
#include <cstring>
#include <map>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdexcept>
#include <sys/socket.h>
#include <sys/time.h>
#include <thread>
#include <unistd.h>

namespace fsdp {

namespace {

enum : uint8_t { kSet = 1, kGet = 2 };

bool writeAll(int fd, const void *p, size_t n) {
  const char *c = static_cast<const char *>(p);
  while (n) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w <= 0)
      return false;
    c += w;
    n -= (size_t)w;
  }
  return true;
}

bool readAll(int fd, void *p, size_t n) {
  char *c = static_cast<char *>(p);
  while (n) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r <= 0)
      return false;
    c += r;
    n -= (size_t)r;
  }
  return true;
}

bool writeBlob(int fd, const std::string &s) {
  uint32_t n = (uint32_t)s.size();
  return writeAll(fd, &n, 4) && writeAll(fd, s.data(), n);
}

bool readBlob(int fd, std::string &s) {
  uint32_t n;
  if (!readAll(fd, &n, 4) || n > (1u << 30))
    return false;
  s.resize(n);
  return readAll(fd, s.data(), n);
}

/// The server: one thread per client, one shared map. It lives as long as
/// the process (rank 0 must keep serving until every rank has met).
struct Server {
  std::mutex mu;
  std::map<std::string, std::string> kv;

  void serve(int client) {
    for (;;) {
      uint8_t op;
      std::string key, value;
      if (!readAll(client, &op, 1) || !readBlob(client, key))
        break;
      if (op == kSet) {
        if (!readBlob(client, value))
          break;
        {
          std::lock_guard<std::mutex> l(mu);
          kv[key] = value;
        }
        uint8_t ack = 1;
        if (!writeAll(client, &ack, 1))
          break;
      } else if (op == kGet) {
        std::string found;
        uint8_t has;
        {
          std::lock_guard<std::mutex> l(mu);
          auto it = kv.find(key);
          has = it != kv.end();
          if (has)
            found = it->second;
        }
        if (!writeAll(client, &has, 1) || (has && !writeBlob(client, found)))
          break;
      } else {
        break;
      }
    }
    ::close(client);
  }
};

int listenOn(int port) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0)
    throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  int one = 1;
  ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons((uint16_t)port);
  if (::bind(s, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) {
    int e = errno;
    ::close(s);
    throw std::runtime_error("cannot serve the rendezvous store on port " +
                             std::to_string(port) + ": " + std::strerror(e) +
                             (e == EADDRINUSE ? " (choose another MASTER_PORT)" : ""));
  }
  ::listen(s, 128);
  return s;
}

} // namespace

TcpStore::TcpStore(const std::string &host, int port, bool serve,
                   std::chrono::milliseconds timeout)
    : timeout(timeout) {
  if (serve) {
    int ls = listenOn(port);
    std::thread([ls] {
      auto *server = new Server; // lives until the process exits
      for (;;) {
        int c = ::accept(ls, nullptr, nullptr);
        if (c < 0)
          continue;
        std::thread(&Server::serve, server, c).detach();
      }
    }).detach();
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    throw std::runtime_error("cannot resolve MASTER_ADDR '" + host + "'");
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0)
      break;
    if (fd >= 0)
      ::close(fd);
    fd = -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ::freeaddrinfo(res);
      throw std::runtime_error("cannot reach the rendezvous store at " + host + ":" +
                               std::to_string(port) + " (is rank 0 running?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::freeaddrinfo(res);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

TcpStore::~TcpStore() {
  if (fd >= 0)
    ::close(fd);
}

void TcpStore::setIoTimeout(std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = t.count() / 1000;
  tv.tv_usec = (t.count() % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

void TcpStore::set(const std::string &key, const std::vector<char> &data) {
  std::lock_guard<std::mutex> l(mu);
  uint8_t op = kSet, ack = 0;
  // A request cut short leaves the stream mid-message: never reuse it.
  if (broken || !writeAll(fd, &op, 1) || !writeBlob(fd, key) ||
      !writeBlob(fd, std::string(data.begin(), data.end())) ||
      !readAll(fd, &ack, 1)) {
    broken = true;
    throw std::runtime_error("the rendezvous store closed the connection or "
                             "did not answer");
  }
}

bool TcpStore::tryGet(const std::string &key, std::vector<char> &out) {
  std::lock_guard<std::mutex> l(mu);
  uint8_t op = kGet, has = 0;
  std::string v;
  if (broken || !writeAll(fd, &op, 1) || !writeBlob(fd, key) ||
      !readAll(fd, &has, 1) || (has && !readBlob(fd, v))) {
    broken = true;
    throw std::runtime_error("the rendezvous store closed the connection or "
                             "did not answer");
  }
  out.assign(v.begin(), v.end());
  return has;
}

std::vector<char> TcpStore::get(const std::string &key) {
  wait({key});
  std::vector<char> out;
  tryGet(key, out);
  return out;
}

void TcpStore::wait(const std::vector<std::string> &keys) { wait(keys, timeout); }

void TcpStore::wait(const std::vector<std::string> &keys,
                    const std::chrono::milliseconds &t) {
  auto deadline = std::chrono::steady_clock::now() + t;
  std::vector<char> tmp;
  for (const std::string &k : keys)
    while (!tryGet(k, tmp)) {
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error("rendezvous timed out after " +
                                 std::to_string(t.count() / 1000.0) +
                                 " s waiting for key '" + k +
                                 "': not every rank joined");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
}

} // namespace fsdp
