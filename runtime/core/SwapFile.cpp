//===- SwapFile.cpp - a rank's optimizer state on disk -------------------===//
//
// Plain pread / pwrite through the page cache: the kernel writes the pages
// back and may keep clean ones while memory is free, but gives them back
// under pressure, unlike the arenas (O_DIRECT would need 4 KiB-aligned
// staging buffers and offsets; the planner aligns to 64 bytes).
//
//===----------------------------------------------------------------------===//

#include "runtime/core/SwapFile.h"

#include "runtime/core/Comm.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace fsdp {

SwapFile::~SwapFile() { close(); }

void SwapFile::close() {
  if (fd >= 0)
    ::close(fd);
  fd = -1;
}

Status SwapFile::open(const std::string &dir, int64_t rank, int64_t n) {
  close();
  struct stat st;
  if (dir.empty() || ::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return FSDP_ERROR("--nvme-dir '", dir, "' is not a directory (the swap file of the plan's ",
                      "optimizer state, ", n, " bytes a rank, goes there)");
  name = dir + "/fsdp-swap." + std::to_string(::getpid()) + ".rank" + std::to_string(rank);
  fd = ::open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return FSDP_ERROR("cannot create the swap file ", name, ": ", std::strerror(errno));
  // Gone from the directory at once: the space is freed when the process
  // ends, however it ends.
  ::unlink(name.c_str());
  bytes = n;
  readTotal = writeTotal = 0;
  if (n > 0) {
    // Reserved whole now (zeros: the optimizer state's initial value).
    int e = ::posix_fallocate(fd, 0, (off_t)n);
    if (e == EOPNOTSUPP || e == EINVAL) // a file system without fallocate
      e = ::ftruncate(fd, (off_t)n) == 0 ? 0 : errno;
    if (e != 0) {
      close();
      return FSDP_ERROR("cannot reserve ", n, " bytes for the swap file in ", dir, ": ",
                        std::strerror(e));
    }
  }
  return Status::ok();
}

Status SwapFile::transfer(bool write, int64_t offset, uint8_t *p, int64_t n, bool counted) const {
  const char *what = write ? "write" : "read";
  if (fd < 0 || offset < 0 || n < 0 || offset + n > bytes)
    return FSDP_ERROR("swap file ", name, ": ", what, " of ", n, " bytes at ", offset,
                      " outside its ", bytes, " bytes");
  for (int64_t done = 0; done < n;) {
    ssize_t k = write ? ::pwrite(fd, p + done, (size_t)(n - done), (off_t)(offset + done))
                      : ::pread(fd, p + done, (size_t)(n - done), (off_t)(offset + done));
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return FSDP_ERROR("swap file ", name, ": ", what, " at ", offset + done, " failed: ",
                        k < 0   ? std::strerror(errno)
                        : write ? "no progress"
                                : "unexpected end of file");
    done += k;
  }
  if (counted)
    __atomic_fetch_add(write ? &writeTotal : &readTotal, n, __ATOMIC_RELAXED);
  return Status::ok();
}

Status SwapFile::read(int64_t offset, void *dst, int64_t n, bool counted) const {
  return transfer(false, offset, static_cast<uint8_t *>(dst), n, counted);
}

Status SwapFile::write(int64_t offset, const void *src, int64_t n, bool counted) const {
  // (transfer only passes the bytes to pwrite, which reads them)
  return transfer(true, offset, static_cast<uint8_t *>(const_cast<void *>(src)), n, counted);
}

Status SwapFile::sync() const {
  if (fd < 0)
    return FSDP_ERROR("swap file: not open");
  if (::fdatasync(fd) != 0)
    return FSDP_ERROR("swap file ", name, ": fdatasync failed: ", std::strerror(errno));
  // Advice only: a file system that keeps no page cache ignores it.
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  return Status::ok();
}

Status calibrateSwap(const std::string &dir, Communicator &comm, nlohmann::json &profile) {
  // 64 MiB a rank in 4 MiB transfers, as the updates' swaps are a unit's
  // state each: written (and made durable), then read back from the disk.
  const int64_t total = int64_t(64) << 20, chunk = int64_t(4) << 20;
  SwapFile f;
  FSDP_RETURN_IF_ERROR(f.open(dir, comm.rank(), total));
  std::vector<uint8_t> buf((size_t)chunk);
  for (size_t i = 0; i < buf.size(); ++i) // not zeros: no sparse shortcut
    buf[i] = (uint8_t)(i * 131 + 7);
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::max(std::chrono::duration<double>(b - a).count(), 1e-9);
  };
  FSDP_RETURN_IF_ERROR(comm.barrier());
  auto t0 = Clock::now();
  for (int64_t off = 0; off < total; off += chunk)
    FSDP_RETURN_IF_ERROR(f.write(off, buf.data(), chunk));
  FSDP_RETURN_IF_ERROR(f.sync());
  auto t1 = Clock::now();
  FSDP_RETURN_IF_ERROR(comm.barrier());
  auto t2 = Clock::now();
  for (int64_t off = 0; off < total; off += chunk)
    FSDP_RETURN_IF_ERROR(f.read(off, buf.data(), chunk));
  auto t3 = Clock::now();
  nlohmann::json &c = profile["compute"];
  c["nvme_write_bytes_per_s"] = (double)total / seconds(t0, t1);
  c["nvme_read_bytes_per_s"] = (double)total / seconds(t2, t3);
  profile["nvme"] = {{"dir", dir}, {"bytes_per_rank", total}, {"ranks", comm.size()}};
  return Status::ok();
}

} // namespace fsdp
