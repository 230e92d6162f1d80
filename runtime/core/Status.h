//===- Status.h - error values for the runtime ------------------*- C++ -*-===//
//
// The runtime reports every failure as a Status carrying file:line and a
// message a user can act on. Library code never calls exit(); only the
// fsdp-run tool turns a failed Status into an exit code.
//
//===----------------------------------------------------------------------===//

#ifndef FSDP_RUNTIME_CORE_STATUS_H
#define FSDP_RUNTIME_CORE_STATUS_H

#include <sstream>
#include <string>
#include <utility>

namespace fsdp {

/// Success, or a message naming what went wrong and where (file:line of the
/// runtime code that noticed it).
class Status {
public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status error(std::string msg) {
    Status s;
    s.ok_ = false;
    s.msg_ = std::move(msg);
    return s;
  }
  bool isOk() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const std::string &message() const { return msg_; }

private:
  bool ok_ = true;
  std::string msg_;
};

namespace detail {
inline void streamAll(std::ostringstream &) {}
template <typename T, typename... Rest>
void streamAll(std::ostringstream &os, const T &v, const Rest &...rest) {
  os << v;
  streamAll(os, rest...);
}
} // namespace detail

/// Builds an error Status "file:line: message" from streamable parts.
template <typename... Args>
Status makeError(const char *file, int line, const Args &...args) {
  std::ostringstream os;
  const char *base = file;
  for (const char *p = file; *p; ++p)
    if (*p == '/')
      base = p + 1;
  os << base << ":" << line << ": ";
  detail::streamAll(os, args...);
  return Status::error(os.str());
}

} // namespace fsdp

/// FSDP_ERROR("expected ", a, ", found ", b) -> Status with file:line.
#define FSDP_ERROR(...) ::fsdp::makeError(__FILE__, __LINE__, __VA_ARGS__)

/// Returns the Status of `expr` from the enclosing function if it failed.
#define FSDP_RETURN_IF_ERROR(expr)                                            \
  do {                                                                         \
    ::fsdp::Status _st = (expr);                                               \
    if (!_st.isOk())                                                           \
      return _st;                                                              \
  } while (0)

#endif // FSDP_RUNTIME_CORE_STATUS_H
