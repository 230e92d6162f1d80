//===- SwapFile.cpp - a rank's optimizer state on disk -------------------===//
//
// Two ways to move the state ([Note: swap file I/O]): O_DIRECT by default
// where the plan and the file system allow it, pread / pwrite through the
// page cache otherwise (or with --nvme-io buffered).
//
//===----------------------------------------------------------------------===//

#include "runtime/core/SwapFile.h"

#include "runtime/core/Comm.h"
#include "runtime/core/PlanSchema.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace fsdp {

// [Note: swap file I/O]
// Through the page cache, every byte the swaps move is copied once more
// by the kernel and the file's pages fill the host's free memory: a 7B
// model's 49 GiB of moments a step on one rank, written back and read
// again, would sit in the cache beside the host arena that
// host-memory-budget sized without them (the kernel gives clean pages
// back under pressure, but writes dirty ones first, on the swap's time).
// With O_DIRECT (DeepSpeed's aio swapper does the same) the drive moves
// the bytes straight between the file and the host arena's staging
// buffers and the cache holds none of them. O_DIRECT needs the file
// offset, the memory address and the length to be multiples of the
// drive's logical block: the plan's swap_alignment (4096) gives each
// swapped buffer and each staging buffer whole blocks of their own, and
// the swaps move them whole (swapIn / swapOut round the length up). The
// checkpoints' and initialization's exact transfers (read / write) bounce
// through an aligned buffer, reading the end blocks first.
// open() turns O_DIRECT on and moves one block each way before trusting
// it: a file system without O_DIRECT (EINVAL), or a drive whose block is
// larger than the alignment, fails there and not in a step. The CPU and
// CUDA devices put the host arena on a page (hostArenaStart), which
// stagingAligned confirms for the plan at hand.

namespace {

struct FreeDeleter {
  void operator()(void *p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<uint8_t, FreeDeleter>;

AlignedBytes alignedBytes(int64_t align, int64_t n) {
  return AlignedBytes(static_cast<uint8_t *>(
      std::aligned_alloc((size_t)align, (size_t)((n + align - 1) / align * align))));
}

int64_t roundUp(int64_t x, int64_t a) { return a > 0 ? (x + a - 1) / a * a : x; }

} // namespace

bool parseSwapIoMode(const std::string &text, SwapIoMode &mode) {
  if (text == "auto")
    mode = SwapIoMode::Auto;
  else if (text == "direct")
    mode = SwapIoMode::Direct;
  else if (text == "buffered")
    mode = SwapIoMode::Buffered;
  else
    return false;
  return true;
}

SwapFile::~SwapFile() { close(); }

void SwapFile::close() {
  if (fd >= 0)
    ::close(fd);
  fd = -1;
  isDirect = false;
  note.clear();
}

Status SwapFile::open(const std::string &dir, int64_t rank, int64_t n, SwapIoMode mode,
                      int64_t align, bool stagingAligned) {
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
  blockBytes = align > 0 && n % align == 0 ? align : 0;
  readTotal = writeTotal = readNs = writeNs = 0;
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
  if (mode == SwapIoMode::Buffered)
    return Status::ok();
  // [Note: swap file I/O]
  std::string why;
  if (align <= 0)
    why = "the plan has no swap_alignment (compiled before direct I/O: recompile it)";
  else if (blockBytes == 0)
    why = "the file's " + std::to_string(n) + " bytes are not whole blocks of " +
          std::to_string(align);
  else if (!stagingAligned)
    why =
        "the host arena's staging buffers are not on " + std::to_string(align) + "-byte boundaries";
  else
    why = tryDirect();
  if (why.empty())
    return Status::ok();
  if (mode == SwapIoMode::Direct) {
    Status e = FSDP_ERROR("--nvme-io direct: the swap file in ", dir,
                          " cannot be read and written with O_DIRECT: ", why,
                          " (--nvme-io buffered goes through the page cache)");
    close();
    return e;
  }
  note = why;
  return Status::ok();
}

std::string SwapFile::tryDirect() {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_DIRECT) != 0)
    return std::string("the file system refuses O_DIRECT (") + std::strerror(errno) + ")";
  // One block each way at the file's start (zeros, as it holds now).
  AlignedBytes block = alignedBytes(blockBytes, blockBytes);
  if (!block)
    return "cannot allocate a " + std::to_string(blockBytes) + "-byte block";
  ssize_t k = ::pread(fd, block.get(), (size_t)blockBytes, 0);
  if (k == (ssize_t)blockBytes)
    k = ::pwrite(fd, block.get(), (size_t)blockBytes, 0);
  if (k == (ssize_t)blockBytes) {
    isDirect = true;
    return "";
  }
  std::string e = k < 0 ? std::strerror(errno) : "a short transfer";
  (void)::fcntl(fd, F_SETFL, flags);
  return "a direct transfer of one " + std::to_string(blockBytes) + "-byte block failed (" + e +
         ")";
}

Status SwapFile::transfer(bool write, int64_t offset, uint8_t *p, int64_t n) const {
  const char *what = write ? "write" : "read";
  if (fd < 0 || offset < 0 || n < 0 || offset + n > bytes)
    return FSDP_ERROR("swap file ", name, ": ", what, " of ", n, " bytes at ", offset,
                      " outside its ", bytes, " bytes");
  if (isDirect && (offset % blockBytes != 0 || n % blockBytes != 0 ||
                   (uintptr_t)p % (uintptr_t)blockBytes != 0))
    return FSDP_ERROR("swap file ", name, ": direct ", what, " of ", n, " bytes at ", offset,
                      " is not in whole ", blockBytes, "-byte blocks");
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
  return Status::ok();
}

Status SwapFile::swap(bool write, int64_t offset, uint8_t *p, int64_t n) const {
  const auto t0 = std::chrono::steady_clock::now();
  FSDP_RETURN_IF_ERROR(transfer(write, offset, p, roundUp(n, blockBytes)));
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  __atomic_fetch_add(write ? &writeTotal : &readTotal, n, __ATOMIC_RELAXED);
  __atomic_fetch_add(write ? &writeNs : &readNs, ns, __ATOMIC_RELAXED);
  return Status::ok();
}

Status SwapFile::swapIn(int64_t offset, void *staging, int64_t n) const {
  return swap(false, offset, static_cast<uint8_t *>(staging), n);
}

Status SwapFile::swapOut(int64_t offset, const void *staging, int64_t n) const {
  // (transfer only passes the bytes to pwrite, which reads them)
  return swap(true, offset, static_cast<uint8_t *>(const_cast<void *>(staging)), n);
}

Status SwapFile::bounced(bool write, int64_t offset, uint8_t *p, int64_t n) const {
  if (offset < 0 || n < 0 || offset + n > bytes)
    return FSDP_ERROR("swap file ", name, ": ", write ? "write" : "read", " of ", n, " bytes at ",
                      offset, " outside its ", bytes, " bytes");
  // Whole blocks around [offset, offset + n), a chunk at a time.
  const int64_t chunk = std::max<int64_t>(blockBytes, int64_t(1) << 20);
  AlignedBytes buf = alignedBytes(blockBytes, chunk);
  if (!buf)
    return FSDP_ERROR("swap file ", name, ": cannot allocate a ", chunk, "-byte bounce buffer");
  const int64_t lo = offset / blockBytes * blockBytes, hi = roundUp(offset + n, blockBytes);
  for (int64_t at = lo; at < hi; at += chunk) {
    const int64_t len = std::min(chunk, hi - at);
    const int64_t from = std::max(at, offset), to = std::min(at + len, offset + n);
    if (!write) {
      FSDP_RETURN_IF_ERROR(transfer(false, at, buf.get(), len));
      std::memcpy(p + (from - offset), buf.get() + (from - at), (size_t)(to - from));
      continue;
    }
    // A write keeps the bytes around its own in the end blocks it shares.
    if (from > at)
      FSDP_RETURN_IF_ERROR(transfer(false, at, buf.get(), blockBytes));
    if (to < at + len)
      FSDP_RETURN_IF_ERROR(
          transfer(false, at + len - blockBytes, buf.get() + len - blockBytes, blockBytes));
    std::memcpy(buf.get() + (from - at), p + (from - offset), (size_t)(to - from));
    FSDP_RETURN_IF_ERROR(transfer(true, at, buf.get(), len));
  }
  return Status::ok();
}

Status SwapFile::read(int64_t offset, void *dst, int64_t n) const {
  return isDirect ? bounced(false, offset, static_cast<uint8_t *>(dst), n)
                  : transfer(false, offset, static_cast<uint8_t *>(dst), n);
}

Status SwapFile::write(int64_t offset, const void *src, int64_t n) const {
  auto *p = static_cast<uint8_t *>(const_cast<void *>(src)); // only read from
  return isDirect ? bounced(true, offset, p, n) : transfer(true, offset, p, n);
}

int64_t SwapFile::cachedBytes() const {
  if (fd < 0 || bytes <= 0)
    return fd < 0 ? -1 : 0;
  void *m = ::mmap(nullptr, (size_t)bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED)
    return -1;
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> resident((size_t)((bytes + page - 1) / page));
  int64_t n = -1;
  if (::mincore(m, (size_t)bytes, resident.data()) == 0) {
    n = 0;
    for (unsigned char r : resident)
      n += (r & 1) ? page : 0;
    n = std::min(n, bytes);
  }
  ::munmap(m, (size_t)bytes);
  return n;
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

Status SwapFile::settle(int64_t offset, int64_t n, bool written) const {
  if (fd < 0)
    return FSDP_ERROR("swap file: not open");
  if (isDirect || n <= 0)
    return Status::ok();
  if (written && ::sync_file_range(fd, (off64_t)offset, (off64_t)n,
                                   SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                       SYNC_FILE_RANGE_WAIT_AFTER) != 0)
    return FSDP_ERROR("swap file ", name, ": sync_file_range failed: ", std::strerror(errno));
  (void)::posix_fadvise(fd, (off_t)offset, (off_t)n, POSIX_FADV_DONTNEED); // advice only
  return Status::ok();
}

namespace {

/// One side of the calibration's duplex phase: the seconds (from the
/// phase's start) at which each of its chunks finished.
struct DuplexSide {
  std::vector<double> ends;
  Status status;
};

/// Of `side`'s chunks, the rate over those finished by `until` (its
/// chunks are back to back, so bytes over the last one's end).
double rateUntil(const DuplexSide &side, double until, int64_t chunk) {
  size_t k = 0;
  while (k < side.ends.size() && side.ends[k] <= until)
    ++k;
  return k == 0 ? 0.0 : double(k) * double(chunk) / std::max(side.ends[k - 1], 1e-9);
}

} // namespace

Status calibrateSwap(const std::string &dir, Communicator &comm, nlohmann::json &profile,
                     SwapIoMode mode) {
  // 64 MiB a rank in 4 MiB transfers, as the updates' swaps are a unit's
  // state each: written, then read back from the disk. Buffered writes are
  // made durable in the timed part (else it times the page cache); a
  // direct write is done when the drive has it, as in training, which
  // never syncs the file.
  const int64_t total = int64_t(64) << 20, chunk = int64_t(4) << 20;
  AlignedBytes buf = alignedBytes(kSwapAlignment, chunk);
  if (!buf)
    return FSDP_ERROR("cannot allocate the calibration's ", chunk, "-byte buffer");
  SwapFile f;
  FSDP_RETURN_IF_ERROR(f.open(dir, comm.rank(), total, mode, kSwapAlignment, true));
  for (int64_t i = 0; i < chunk; ++i) // not zeros: no sparse shortcut
    buf.get()[i] = (uint8_t)(i * 131 + 7);
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::max(std::chrono::duration<double>(b - a).count(), 1e-9);
  };
  FSDP_RETURN_IF_ERROR(comm.barrier());
  auto t0 = Clock::now();
  for (int64_t off = 0; off < total; off += chunk)
    FSDP_RETURN_IF_ERROR(f.swapOut(off, buf.get(), chunk));
  if (!f.direct())
    FSDP_RETURN_IF_ERROR(f.sync());
  auto t1 = Clock::now();
  if (f.direct()) // (nothing cached to drop: the reads below come from the disk)
    FSDP_RETURN_IF_ERROR(f.sync());
  FSDP_RETURN_IF_ERROR(comm.barrier());
  auto t2 = Clock::now();
  for (int64_t off = 0; off < total; off += chunk)
    FSDP_RETURN_IF_ERROR(f.swapIn(off, buf.get(), chunk));
  auto t3 = Clock::now();
  const double writeRate = (double)total / seconds(t0, t1);
  const double readRate = (double)total / seconds(t2, t3);

  // Duplex: a reader round and round the first half of the file (written
  // above, its pages dropped) and a writer round and round the second,
  // until each has moved half the file. Each one's rate is over the chunks
  // it finished while the other still ran: until the slower one's last.
  // Buffered, every chunk is settled (written back, dropped) so that
  // neither side runs from the page cache.
  FSDP_RETURN_IF_ERROR(f.sync());
  AlignedBytes rbuf = alignedBytes(kSwapAlignment, chunk);
  if (!rbuf)
    return FSDP_ERROR("cannot allocate the calibration's ", chunk, "-byte buffer");
  const int64_t half = total / 2;
  std::atomic<int> halfway{0}; // sides that have moved half the file
  std::atomic<bool> failed{false};
  DuplexSide reads, writes;
  FSDP_RETURN_IF_ERROR(comm.barrier());
  const auto t4 = Clock::now();
  auto side = [&](bool write, DuplexSide &out) {
    uint8_t *p = write ? buf.get() : rbuf.get();
    for (int64_t moved = 0; halfway.load() < 2 && !failed.load(); moved += chunk) {
      const int64_t off = (write ? half : 0) + moved % half;
      Status st = write ? f.swapOut(off, p, chunk) : f.swapIn(off, p, chunk);
      if (st)
        st = f.settle(off, chunk, write);
      if (!st) {
        out.status = st;
        failed = true;
        return;
      }
      out.ends.push_back(seconds(t4, Clock::now()));
      if (moved + chunk == half)
        ++halfway;
    }
  };
  std::thread reader(side, false, std::ref(reads));
  side(true, writes);
  reader.join();
  FSDP_RETURN_IF_ERROR(reads.status);
  FSDP_RETURN_IF_ERROR(writes.status);
  const size_t k = size_t(half / chunk);
  const double window = std::max(reads.ends.at(k - 1), writes.ends.at(k - 1));
  const double duplexRead = rateUntil(reads, window, chunk);
  const double duplexWrite = rateUntil(writes, window, chunk);
  FSDP_RETURN_IF_ERROR(comm.barrier());

  nlohmann::json &c = profile["compute"];
  c["nvme_write_bytes_per_s"] = writeRate;
  c["nvme_read_bytes_per_s"] = readRate;
  // (above 1, within the timing's noise, is no contention: 1)
  c["nvme_duplex_read_share"] = std::min(1.0, duplexRead / readRate);
  c["nvme_duplex_write_share"] = std::min(1.0, duplexWrite / writeRate);
  profile["nvme"] = {{"dir", dir},
                     {"bytes_per_rank", total},
                     {"ranks", comm.size()},
                     {"io", f.direct() ? "direct" : "buffered"},
                     {"duplex_read_bytes_per_s", duplexRead},
                     {"duplex_write_bytes_per_s", duplexWrite}};
  if (!f.directNote().empty())
    profile["nvme"]["io_note"] = f.directNote();
  return Status::ok();
}

} // namespace fsdp
