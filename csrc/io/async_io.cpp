// AsyncIO: request splitting, bounce buffers, short-transfer resubmission and error capture, over an
// io_uring service thread or a pool of pread/pwrite workers.
#include "async_io.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include "crc32c.h"

namespace mobiuspipe {
namespace {

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

}  // namespace

AsyncIO::AsyncIO(const std::string& backend, int64_t queue_depth, int64_t block_bytes)
    : queue_depth_(queue_depth), block_bytes_(block_bytes),
      block_shift_(crc32c_shift(static_cast<size_t>(block_bytes))) {
  TORCH_CHECK(backend == "auto" || backend == "uring" || backend == "threads",
              "backend must be 'auto', 'uring' or 'threads', not '", backend, "'");
  TORCH_CHECK(queue_depth >= 1 && queue_depth <= 4096, "queue_depth must be in [1, 4096], not ", queue_depth);
  TORCH_CHECK(block_bytes >= kAlign && block_bytes % kAlign == 0, "block_bytes must be a positive multiple of ", kAlign,
              ", not ", block_bytes);
  if (backend != "threads") {
    ring_ = Uring::create(static_cast<unsigned>(queue_depth), &why_not_uring_);
    TORCH_CHECK(ring_ || backend == "auto", "io_uring refused by this kernel or sandbox (", why_not_uring_,
                "): use backend='threads' or 'auto'");
  }
  if (ring_) {
    workers_.emplace_back([this] { uring_loop(); });
    const unsigned cores = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
    for (unsigned i = 0; i < cores; ++i) finishers_.emplace_back([this] { finisher_loop(); });
  } else {
    for (int64_t i = 0; i < queue_depth_; ++i) workers_.emplace_back([this] { thread_loop(); });
  }
}

AsyncIO::~AsyncIO() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;  // workers finish what is queued, then leave
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();  // the ring drains into the finishers first
  {
    std::lock_guard<std::mutex> lk(finish_mu_);
    finish_stop_ = true;
  }
  finish_cv_.notify_all();
  for (auto& t : finishers_) t.join();
  for (char* p : bounce_all_) std::free(p);
}

int64_t AsyncIO::submit(int64_t fd, torch::Tensor t, int64_t offset, bool write, bool direct, bool checksum) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "the tensor must be a contiguous CPU tensor");
  TORCH_CHECK(fd >= 0 && offset >= 0, "fd and offset must be >= 0 (fd ", fd, ", offset ", offset, ")");
  TORCH_CHECK(!direct || offset % kAlign == 0, "an O_DIRECT file offset must be a multiple of ", kAlign, ", not ",
              offset);
  auto r = std::make_unique<Request>();
  r->keep = t;
  r->fd = static_cast<int>(fd);
  r->write = write;
  r->direct = direct;
  r->checksum = checksum;
  const int64_t n = t.numel() * t.element_size();
  char* base = static_cast<char*>(t.data_ptr());
  for (int64_t at = 0; at < n; at += block_bytes_) {
    Block b;
    b.req = r.get();
    b.file_off = offset + at;
    b.user = base + at;
    b.len = std::min(block_bytes_, n - at);
    b.bounced = direct && (!aligned(b.user) || b.len % kAlign != 0);
    b.io_len = b.bounced ? round_up(b.len, kAlign) : b.len;
    r->blocks.push_back(b);
  }
  r->blocks_left = static_cast<int64_t>(r->blocks.size());
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& b : r->blocks) b.fixed = b.bounced ? -1 : fixed_index(b.user, b.io_len);
  const int64_t ticket = next_ticket_++;
  Request* req = r.get();
  requests_.emplace(ticket, std::move(r));
  if (req->blocks.empty() || broken_) {
    if (broken_) fail(req, broken_, offset);
    req->blocks_left = 0;
    req->done = true;
    return ticket;
  }
  for (auto& b : req->blocks) queue_.push_back(&b);
  work_cv_.notify_all();
  return ticket;
}

std::tuple<int64_t, int64_t, int64_t, int64_t> AsyncIO::wait(int64_t ticket) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = requests_.find(ticket);
  TORCH_CHECK(it != requests_.end(), "unknown or already waited-for ticket ", ticket);
  Request* r = it->second.get();
  done_cv_.wait(lk, [r] { return r->done; });
  std::unique_ptr<Request> gone = std::move(it->second);
  requests_.erase(it);
  lk.unlock();  // the tensor reference drops outside the lock
  uint32_t crc = 0;
  if (r->checksum && r->status == 0) {
    for (const Block& b : r->blocks) {
      crc = b.len == block_bytes_ ? crc32c_mulmod(block_shift_, crc) ^ b.crc
                                  : crc32c_combine(crc, b.crc, static_cast<size_t>(b.len));
    }
  }
  return std::make_tuple(r->status, r->fail_offset, r->bytes_done, static_cast<int64_t>(crc));
}

bool AsyncIO::done(int64_t ticket) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(ticket);
  TORCH_CHECK(it != requests_.end(), "unknown or already waited-for ticket ", ticket);
  return it->second->done;
}

int64_t AsyncIO::pending() {
  std::lock_guard<std::mutex> lk(mu_);
  int64_t n = 0;
  for (auto& kv : requests_) n += !kv.second->done;
  return n;
}

int AsyncIO::fixed_index(const char* p, int64_t n) const {
  for (size_t i = 0; i < fixed_.size(); ++i) {
    const char* base = static_cast<const char*>(fixed_[i].data_ptr());
    if (p >= base && p + n <= base + fixed_[i].numel() * fixed_[i].element_size()) return static_cast<int>(i);
  }
  return -1;
}

std::string AsyncIO::register_buffers(std::vector<torch::Tensor> buffers) {
  if (!ring_) return "the threads backend has no registered buffers";
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(fixed_.empty(), "buffers are already registered with this engine (once per engine)");
  for (auto& kv : requests_) TORCH_CHECK(kv.second->done, "register buffers while no I/O is in flight");
  std::vector<iovec> iovs;
  for (auto& t : buffers) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "registered buffers must be contiguous CPU tensors");
    iovs.push_back({t.data_ptr(), static_cast<size_t>(t.numel() * t.element_size())});
  }
  const int rc = ring_->register_buffers(iovs.data(), static_cast<unsigned>(iovs.size()));
  if (rc < 0) return std::string("io_uring_register: ") + std::strerror(-rc);
  fixed_ = std::move(buffers);
  return "";
}

void AsyncIO::inject_fault(int64_t nth, int64_t err, int64_t short_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  fault_err_ = err;
  fault_short_ = short_bytes;
  fault_countdown_.store(nth);
}

int64_t AsyncIO::apply_fault(int64_t res) {
  if (fault_countdown_.load() < 0) return res;
  if (fault_countdown_.fetch_sub(1) != 0) return res;
  std::lock_guard<std::mutex> lk(mu_);
  if (fault_err_ > 0) return -fault_err_;
  return res < 0 ? res : std::min(res, fault_short_);
}

void AsyncIO::fail(Request* r, int64_t status, int64_t offset) {  // caller holds mu_; the lowest offset wins
  if (r->status == 0 || offset < r->fail_offset) {
    r->status = status;
    r->fail_offset = offset;
  }
}

char* AsyncIO::take_bounce() {
  std::lock_guard<std::mutex> lk(bounce_mu_);
  if (!bounce_free_.empty()) {
    char* p = bounce_free_.back();
    bounce_free_.pop_back();
    return p;
  }
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, kAlign, block_bytes_) == 0, "cannot allocate a ", block_bytes_, "-byte bounce buffer");
  bounce_all_.push_back(static_cast<char*>(p));
  return static_cast<char*>(p);
}

void AsyncIO::give_bounce(char* p) {
  std::lock_guard<std::mutex> lk(bounce_mu_);
  bounce_free_.push_back(p);
}

void AsyncIO::start(Block* b, char* bounce) {
  b->progress = 0;
  b->bounce = bounce;
  if (b->bounced && b->req->write) {
    std::memcpy(bounce, b->user, b->len);
    std::memset(bounce + b->len, 0, b->io_len - b->len);  // O_DIRECT pads the tail with zeros
  }
  b->iov.iov_base = b->bounced ? bounce : b->user;
  b->iov.iov_len = static_cast<size_t>(b->io_len);
}

bool AsyncIO::finish_io(Block* b, int64_t res) {
  res = apply_fault(res);
  Request* r = b->req;
  if (res < 0) {
    std::lock_guard<std::mutex> lk(mu_);
    fail(r, -res, b->file_off + b->progress);
    return false;
  }
  b->progress += res;
  if (b->progress >= b->io_len || (!r->write && b->progress >= b->len)) {  // a read may end in the padding
    b->ok = true;
    return false;
  }
  if (res == 0 || (r->direct && b->progress % kAlign != 0)) {  // no progress, or a tail O_DIRECT cannot resume
    std::lock_guard<std::mutex> lk(mu_);
    fail(r, r->write ? kShortWrite : kShortRead, b->file_off + b->progress);
    return false;
  }
  b->iov.iov_base = static_cast<char*>(b->bounced ? b->bounce : b->user) + b->progress;
  b->iov.iov_len = static_cast<size_t>(b->io_len - b->progress);
  return true;
}

void AsyncIO::block_done(Block* b) {
  Request* r = b->req;
  if (b->ok && b->bounced && !r->write) std::memcpy(b->user, b->bounce, b->len);
  if (b->ok && r->checksum) b->crc = crc32c(0, b->user, static_cast<size_t>(b->len));
  std::lock_guard<std::mutex> lk(mu_);
  if (b->ok) r->bytes_done += b->len;
  piece_ended(r);
}

void AsyncIO::piece_ended(Request* r) {  // caller holds mu_
  if (--r->blocks_left == 0) {
    r->done = true;
    done_cv_.notify_all();
  }
}

void AsyncIO::thread_loop() {
  char* bounce = nullptr;
  for (;;) {
    Block* b = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) break;
      b = queue_.front();
      queue_.pop_front();
      if (b->req->status != 0) {  // the request already failed: skip its remaining pieces
        lk.unlock();
        block_done(b);
        continue;
      }
    }
    if (b->bounced && !bounce) bounce = take_bounce();
    start(b, bounce);
    for (;;) {
      const off_t off = static_cast<off_t>(b->file_off + b->progress);
      ssize_t n = b->req->write ? pwrite(b->req->fd, b->iov.iov_base, b->iov.iov_len, off)
                                : pread(b->req->fd, b->iov.iov_base, b->iov.iov_len, off);
      if (n < 0 && errno == EINTR) continue;
      if (!finish_io(b, n < 0 ? -errno : n)) break;
    }
    block_done(b);
  }
  if (bounce) give_bounce(bounce);
}

void AsyncIO::fail_all(int64_t err) {  // caller holds mu_: the ring is unusable
  broken_ = err;
  for (Block* b : queue_) {
    fail(b->req, err, b->file_off);
    piece_ended(b->req);
  }
  queue_.clear();
}

void AsyncIO::post_finish(Block* b) {
  {
    std::lock_guard<std::mutex> lk(finish_mu_);
    finish_q_.push_back(b);  // copies out of bounce buffers and checksums run beside the ring
  }
  finish_cv_.notify_one();
}

void AsyncIO::uring_loop() {
  std::vector<Block*> ready;        // started pieces (new, or the rest of a short transfer) to put in the ring
  std::unordered_set<Block*> held;  // pieces given to the ring and not yet reaped
  int fatal = 0;                    // io_uring_enter failures in a row
  const unsigned cap = ring_->entries();
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (held.empty() && ready.empty()) work_cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty() && held.empty() && ready.empty()) return;
      while (held.size() + ready.size() < cap && !queue_.empty()) {
        Block* b = queue_.front();
        queue_.pop_front();
        if (b->req->status != 0) {  // the request already failed: skip its remaining pieces
          piece_ended(b->req);
          continue;
        }
        b->progress = -1;  // marks "not started" for the loop below
        ready.push_back(b);
      }
    }
    for (Block* b : ready) {
      if (b->progress < 0) start(b, b->bounced ? take_bounce() : nullptr);
      const auto off = static_cast<uint64_t>(b->file_off + b->progress);
      const auto data = reinterpret_cast<uint64_t>(b);
      if (b->fixed >= 0) {
        ring_->prep_fixed(b->req->write, b->req->fd, b->iov.iov_base, static_cast<uint32_t>(b->iov.iov_len), off,
                          static_cast<uint16_t>(b->fixed), data);
      } else {
        ring_->prep(b->req->write, b->req->fd, &b->iov, off, data);
      }
      held.insert(b);
    }
    ready.clear();
    const int rc = held.empty() ? 0 : ring_->submit_and_wait(1);
    if (rc < 0 && rc != -EAGAIN && rc != -EBUSY) {
      std::lock_guard<std::mutex> lk(mu_);
      fail_all(-rc);  // later submits fail at once; pieces already in the kernel still complete below
    }
    fatal = (rc < 0 && rc != -EAGAIN && rc != -EBUSY) ? fatal + 1 : 0;
    ring_->reap([&](uint64_t data, int32_t res) {
      Block* b = reinterpret_cast<Block*>(data);
      held.erase(b);
      if (finish_io(b, res)) ready.push_back(b);
      else post_finish(b);
    });
    if (fatal >= 100) {  // the ring is unusable: fail what it holds rather than hang every waiter
      for (Block* b : held) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          fail(b->req, broken_, b->file_off + b->progress);
        }
        post_finish(b);
      }
      held.clear();
    } else if (fatal) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

void AsyncIO::finisher_loop() {
  for (;;) {
    Block* b = nullptr;
    {
      std::unique_lock<std::mutex> lk(finish_mu_);
      finish_cv_.wait(lk, [this] { return finish_stop_ || !finish_q_.empty(); });
      if (finish_q_.empty()) return;
      b = finish_q_.front();
      finish_q_.pop_front();
    }
    char* bounce = b->bounce;  // b may be freed by a waiter once block_done returns
    block_done(b);
    if (bounce) give_bounce(bounce);
  }
}

}  // namespace mobiuspipe
