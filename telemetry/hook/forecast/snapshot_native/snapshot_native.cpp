// memtel's allocator-snapshot reader: the CUDA caching allocator's segments as one compact bytes object.
//
// torch.cuda.memory_snapshot() builds a Python dict per segment and per block while holding the GIL (1.8 ms at
// 556 segments, 16 ms at 5,000 on an H200), so a serving thread that wants the GIL waits that long. This module
// takes the same C++ snapshot (c10::cuda::CUDACachingAllocator::snapshot(), which copies the segments under each
// device allocator's lock) and serialises what memtel's simulator reads, all with the GIL released; under the
// GIL it only builds the one bytes object. The format is decoded by codec.py beside this file (FORMAT there);
// built by build.py with torch.utils.cpp_extension against the torch that loads it (the layout of SegmentInfo is
// that torch's: a build is never reused across torch versions).
//
// The event log (events.py beside this file: its format; docs/hook.md, "The event shadow"): `attach_events(cap)`
// attaches an allocator trace tracker (c10's attachAllocatorTraceTracker: called under the device allocator's
// lock at every trace event, whether or not the memory history is recorded). The callback appends one 48-byte
// record to a log of fixed-size chunks under its own mutex and returns: no Python, no CUDA, no copy of what is
// logged; an allocation only for a new chunk when no emptied one is kept (past the cap it drops the event and
// marks the log overflowed). `take_events()` swaps the chunks out under that mutex (O(1)) and writes them into a
// bytes object with the GIL released. A snapshot taken by this module leaves one SNAPSHOT record per
// device allocator, at the point of the copy (what came before it is in the snapshot; what came after is not).

#include <pybind11/pybind11.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace py = pybind11;
namespace alloc = c10::cuda::CUDACachingAllocator;

namespace {

constexpr uint16_t kFormatVersion = 1;
constexpr uint16_t kEventsVersion = 1;
constexpr uint16_t kOverflowed = 1;  // events flags
constexpr uint16_t kNoPool = 2;      // this torch's trace entries carry no memory pool id
constexpr uint32_t kLarge = 1;       // segment flags
constexpr uint32_t kExpandable = 2;
constexpr uint8_t kInactive = 0;     // block states, as torch names them in memory_snapshot()
constexpr uint8_t kActiveAllocated = 1;
constexpr uint8_t kActivePendingFree = 2;

void put(std::string& out, uint64_t value, int bytes) {   // little-endian, whatever the host
  for (int i = 0; i < bytes; ++i) {
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
}

// A stream as its bits: a cudaStream_t (a pointer), or an integer in a torch that kept it so.
template <typename T>
uint64_t bits(T* pointer) {
  return reinterpret_cast<uintptr_t>(pointer);
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
uint64_t bits(T value) {
  return static_cast<uint64_t>(value);
}

// torch >= 2.5 takes (mempool_id, include_traces): leave the allocation history out. Older: no arguments.
template <typename Pool>
auto take(Pool pool, int) -> decltype(alloc::snapshot(pool, false)) {
  return alloc::snapshot(pool, false);
}
template <typename Pool>
auto take(Pool, long) -> decltype(alloc::snapshot()) {
  return alloc::snapshot();
}

// Whether releasing the copy may drop the last reference to a recorded stack trace (whose release may need the
// GIL): then it is released with the GIL held.
template <typename Info>
bool holds_contexts(const Info& info) {
  for (const auto& traces : info.device_traces) {
    if (!traces.empty()) {
      return true;
    }
  }
  for (const auto& segment : info.segments) {
    if (segment.context_when_allocated) {
      return true;
    }
    for (const auto& block : segment.blocks) {
      if (block.context_when_allocated) {
        return true;
      }
    }
  }
  return false;
}

template <typename Info>
void encode(const Info& info, std::string& out) {
  uint64_t blocks = 0;
  for (const auto& segment : info.segments) {
    blocks += segment.blocks.size();
  }
  out.reserve(16 + 56 * info.segments.size() + 16 * blocks);
  out.append("MTAS", 4);
  put(out, kFormatVersion, 2);
  put(out, 0, 2);
  put(out, info.segments.size(), 4);
  put(out, blocks, 4);
  for (const auto& segment : info.segments) {
    put(out, static_cast<uint32_t>(static_cast<int32_t>(segment.device)), 4);
    put(out, (segment.is_large ? kLarge : 0) | (segment.is_expandable ? kExpandable : 0), 4);
    put(out, segment.address, 8);
    put(out, segment.total_size, 8);
    put(out, bits(segment.stream), 8);
    put(out, segment.owner_private_pool_id.first, 8);
    put(out, segment.owner_private_pool_id.second, 8);
    put(out, segment.blocks.size(), 4);
    put(out, 0, 4);
    for (const auto& block : segment.blocks) {
      put(out, block.size, 8);
      uint8_t state = block.allocated ? kActiveAllocated : (block.active ? kActivePendingFree : kInactive);
      put(out, state, 1);
      put(out, 0, 7);
    }
  }
}

// ---- the event log -------------------------------------------------------------------------------------------

struct Record {  // 48 bytes, written as they are (events.py: RECORD)
  uint8_t action;
  uint8_t pad0;
  int16_t device;   // for this module's SNAPSHOT records: the device allocator's index in the snapshot
  uint32_t pad1;
  uint64_t addr;
  uint64_t size;
  uint64_t stream;
  uint64_t pool0;
  uint64_t pool1;
};
static_assert(sizeof(Record) == 48, "the event record is 48 bytes");
static_assert(offsetof(Record, addr) == 8 && offsetof(Record, pool1) == 40, "the event record's layout");
constexpr bool kLittleEndian = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

// The log is a list of fixed-size chunks: appending never copies what is there (a growing vector would copy
// megabytes while the allocator's lock is held); emptied chunks are kept for reuse, up to kKeptChunks.
constexpr size_t kChunk = 4096;        // records (192 KiB)
constexpr size_t kKeptChunks = 64;
using Chunk = std::vector<Record>;

// Never destroyed: the allocator may call the tracker during the process's exit, after static destructors.
std::mutex& log_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}
std::vector<Chunk*>* g_chunks = new std::vector<Chunk*>();  // under log_mutex(): the log, the last chunk filling
std::vector<Chunk*>* g_free = new std::vector<Chunk*>();    // under log_mutex(): emptied chunks
std::mutex* g_take = new std::mutex();                      // one take at a time
size_t g_count = 0;                                         // under log_mutex(): records in the log
size_t g_cap = 0;                                           // under log_mutex(); 0: not attached
bool g_overflowed = false;                                  // under log_mutex()
bool g_attached = false;                                    // under log_mutex()
bool g_coalesce = false;                                    // under log_mutex(): drop alloc/free pairs (below)
uint64_t g_coalesced = 0;                                   // under log_mutex(): pairs dropped since attached
thread_local int t_snapshot_marks = -1;                     // >= 0 while this thread takes this module's snapshot

// Append under log_mutex() (std::bad_alloc where a new chunk cannot be had).
void append(const Record& record) {
  Chunk* chunk = g_chunks->empty() ? nullptr : g_chunks->back();
  if (chunk == nullptr || chunk->size() == kChunk) {
    if (!g_free->empty()) {
      chunk = g_free->back();
      g_free->pop_back();
    } else {
      auto fresh = std::make_unique<Chunk>();
      fresh->reserve(kChunk);
      chunk = fresh.release();
    }
    g_chunks->push_back(chunk);
  }
  chunk->push_back(record);   // within the reserved capacity: no allocation
  ++g_count;
}

// Whether this torch's trace entries carry the memory pool (`mempool_`): without it the shadow cannot tell a private
// pool's events from the default pools' and resyncs at the first event.
template <typename E, typename = void>
struct HasPool : std::false_type {};
template <typename E>
struct HasPool<E, std::void_t<decltype(std::declval<const E&>().mempool_)>> : std::true_type {};

template <typename E>
std::pair<uint64_t, uint64_t> pool_of(const E& entry) {
  if constexpr (HasPool<E>::value) {
    return {static_cast<uint64_t>(entry.mempool_.first), static_cast<uint64_t>(entry.mempool_.second)};
  } else {
    return {~uint64_t{0}, ~uint64_t{0}};
  }
}

bool same_block(const Record& a, const Record& b) {
  return a.addr == b.addr && a.device == b.device && a.stream == b.stream && a.pool0 == b.pool0 &&
         a.pool1 == b.pool1;
}

// A block allocated and freed with nothing logged in between leaves the allocator's blocks and segments as they
// were (the split is merged back; free blocks are ordered by stream, size and address, not by age), so the three
// records (ALLOC, FREE_REQUESTED, FREE_COMPLETED) are dropped instead of logged: a tensor made and freed in a
// step costs the log nothing, and pairs nested inside one another go the same way, innermost first. Not under a
// garbage-collection threshold, where each allocation also ages the pool's free blocks (the caller decides).
// Only where the record before the ALLOC is seen and is not a segment's: the segment calls an allocation makes
// (a new segment, pages mapped, cached segments released to make room) are logged just before its ALLOC and stay
// with it, so the shadow replays them with the allocation that made them. Under log_mutex().
bool coalesce(const Record& freed, uint8_t alloc_action, uint8_t requested_action, uint8_t first_segment_action,
              uint8_t last_segment_action) {
  if (g_chunks->empty()) {
    return false;
  }
  Chunk* chunk = g_chunks->back();
  const size_t n = chunk->size();
  if (n < 3) {
    return false;   // the pair or the record before it is in another chunk or an earlier take: logged as it is
  }
  const Record& requested = (*chunk)[n - 1];
  const Record& allocated = (*chunk)[n - 2];
  const Record& before = (*chunk)[n - 3];
  if (requested.action != requested_action || allocated.action != alloc_action || !same_block(requested, freed) ||
      !same_block(allocated, freed) ||
      (before.action >= first_segment_action && before.action <= last_segment_action)) {
    return false;
  }
  chunk->pop_back();
  chunk->pop_back();
  g_count -= 2;
  ++g_coalesced;
  return true;
}

template <typename E>
void track(const E& entry) noexcept {
  Record record{};
  record.action = static_cast<uint8_t>(entry.action_);
  record.device = static_cast<int16_t>(entry.device_);
  if (entry.action_ == E::SNAPSHOT) {
    if (t_snapshot_marks < 0) {
      return;   // another reader's snapshot: it changes nothing
    }
    record.device = static_cast<int16_t>(t_snapshot_marks++);
  } else {
    record.addr = static_cast<uint64_t>(entry.addr_);
    record.size = static_cast<uint64_t>(entry.size_);
    record.stream = bits(entry.stream_);
    auto pool = pool_of(entry);
    record.pool0 = pool.first;
    record.pool1 = pool.second;
  }
  std::lock_guard<std::mutex> guard(log_mutex());
  if (g_overflowed) {
    return;
  }
  if (g_coalesce && entry.action_ == E::FREE_COMPLETED &&
      coalesce(record, static_cast<uint8_t>(E::ALLOC), static_cast<uint8_t>(E::FREE_REQUESTED),
               static_cast<uint8_t>(E::SEGMENT_ALLOC), static_cast<uint8_t>(E::SEGMENT_UNMAP))) {
    return;
  }
  if (g_count >= g_cap) {
    g_overflowed = true;
    return;
  }
  try {
    append(record);
  } catch (...) {   // out of host memory: the log is marked, the allocator goes on
    g_overflowed = true;
  }
}

// Attach the tracker once per process (it cannot be detached: after `detach` it only drops what it is given);
// cap: the most events kept between two takes.
bool attach_events(uint64_t cap, bool coalesce_pairs) {
  using Entry = alloc::TraceEntry;
  {
    std::lock_guard<std::mutex> guard(log_mutex());
    g_cap = static_cast<size_t>(cap);
    g_coalesce = coalesce_pairs;
    g_overflowed = false;   // what came before is in the full snapshot the shadow starts from
    g_chunks->reserve(g_cap / kChunk + 2);   // the list of chunks never grows under the allocator's lock
    if (g_attached) {
      return true;
    }
  }
  {
    py::gil_scoped_release no_gil;
    alloc::attachAllocatorTraceTracker([](const Entry& entry) { track(entry); });
  }
  std::lock_guard<std::mutex> guard(log_mutex());
  g_attached = true;
  return true;
}

void release(std::vector<Chunk*>& chunks) {   // chunks back to the free list (a few kept), under log_mutex()
  for (Chunk* chunk : chunks) {
    chunk->clear();
    if (g_free->size() < kKeptChunks) {
      g_free->push_back(chunk);
    } else {
      delete chunk;
    }
  }
  chunks.clear();
}

void detach_events() {
  std::lock_guard<std::mutex> guard(log_mutex());
  g_cap = 0;
  g_overflowed = true;
  g_count = 0;
  release(*g_chunks);
}

// The events since the last take: header "MTAE", version (u16), flags (u16), records (u32), 4 bytes of 0, then
// the records (48 bytes each, RECORD in events.py). The bytes object is made under the GIL (an allocation) and
// filled without it; the log is swapped out under its mutex in O(1).
py::object take_events() {
  std::lock_guard<std::mutex> taking(*g_take);
  std::vector<Chunk*> taken;
  bool overflowed;
  size_t count;
  {
    py::gil_scoped_release no_gil;
    std::lock_guard<std::mutex> guard(log_mutex());
    taken.swap(*g_chunks);
    g_chunks->reserve(g_cap / kChunk + 2);
    count = g_count;
    g_count = 0;
    overflowed = g_overflowed;
    g_overflowed = g_cap == 0;
  }
  const size_t size = 16 + sizeof(Record) * count;
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
  if (raw == nullptr) {
    std::lock_guard<std::mutex> guard(log_mutex());
    release(taken);
    g_overflowed = true;   // those events are gone
    throw py::error_already_set();
  }
  py::object out = py::reinterpret_steal<py::object>(raw);
  char* data = PyBytes_AS_STRING(raw);   // nobody else holds the new object: filled without the GIL
  {
    py::gil_scoped_release no_gil;
    uint16_t flags = (overflowed ? kOverflowed : 0) | (HasPool<alloc::TraceEntry>::value ? 0 : kNoPool);
    std::string head;
    head.append("MTAE", 4);
    put(head, kEventsVersion, 2);
    put(head, flags, 2);
    put(head, count, 4);
    put(head, 0, 4);
    std::memcpy(data, head.data(), 16);
    char* cursor = data + 16;
    for (const Chunk* chunk : taken) {
      for (const Record& r : *chunk) {
        if constexpr (kLittleEndian) {
          std::memcpy(cursor, &r, sizeof(Record));   // the record's layout is the format's (padding zeroed)
        } else {
          std::string one;
          one.reserve(sizeof(Record));
          put(one, r.action, 1);
          put(one, 0, 1);
          put(one, static_cast<uint16_t>(r.device), 2);
          put(one, 0, 4);
          put(one, r.addr, 8);
          put(one, r.size, 8);
          put(one, r.stream, 8);
          put(one, r.pool0, 8);
          put(one, r.pool1, 8);
          std::memcpy(cursor, one.data(), sizeof(Record));
        }
        cursor += sizeof(Record);
      }
    }
    std::lock_guard<std::mutex> guard(log_mutex());
    release(taken);
  }
  return out;
}

py::bytes snapshot_bytes() {
  using Info = decltype(take(std::pair<unsigned long long, unsigned long long>{0, 0}, 0));
  std::unique_ptr<Info> info;
  std::string out;
  {
    py::gil_scoped_release no_gil;
    t_snapshot_marks = 0;   // the tracker numbers this snapshot's SNAPSHOT records by device allocator
    try {
      info = std::make_unique<Info>(take(std::pair<unsigned long long, unsigned long long>{0, 0}, 0));
    } catch (...) {
      t_snapshot_marks = -1;
      throw;
    }
    t_snapshot_marks = -1;
    encode(*info, out);
    if (!holds_contexts(*info)) {
      info.reset();
    }
  }
  info.reset();   // here with the GIL: only a copy that holds recorded stack traces
  return py::bytes(out.data(), out.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memtel: the CUDA caching allocator's segments as bytes, taken without holding the GIL";
  m.attr("FORMAT_VERSION") = kFormatVersion;
  m.attr("EVENTS_VERSION") = kEventsVersion;
  m.def("snapshot_bytes", &snapshot_bytes,
        "Every device's allocator segments and blocks, serialised (memtel's codec.py decodes them).");
  m.def("coalesced", []() {
    std::lock_guard<std::mutex> guard(log_mutex());
    return g_coalesced;
  }, "Alloc/free pairs left out of the log since the tracker was attached.");
  m.def("attach_events", &attach_events, py::arg("cap"), py::arg("coalesce") = false,
        "Log the allocator's trace events from now on (at most cap between two takes); once per process.");
  m.def("detach_events", &detach_events, "Stop logging (the tracker stays attached and drops what it gets).");
  m.def("take_events", &take_events, "The events logged since the last take, serialised (events.py decodes them).");
}
