// Local multi-process launcher. Plain POSIX on purpose: the launcher must stay light and must not
// initialise LibTorch (thread pools, CUDA) in a process whose only job is to fork the ranks.
#include "shardrl/launcher.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace shardrl::dist {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kKillAfterTermSeconds = 5.0;
constexpr double kMaxGraceSeconds = 7 * 24 * 3600.0;
// Bounds the memory a rank can pin by writing without newlines (progress bars, binary junk).
constexpr size_t kMaxLineBytes = 64 * 1024;
// Safety net: the loop re-checks children even if a wake-up byte was lost to a full pipe.
constexpr int kMaxPollMillis = 1000;
constexpr int kExecFailedStatus = 127;

[[noreturn]] void ThrowErrno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), "shardrl launch: " + what);
}

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    Reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Keeps descriptors off 0-2 so that a child's dup2() onto its stdio can never clobber a
// descriptor it still has to dup (possible when the launcher itself started with stdio closed).
UniqueFd AboveStdio(UniqueFd fd) {
  if (fd.get() > 2) return fd;
  int moved = fcntl(fd.get(), F_DUPFD_CLOEXEC, 3);
  if (moved < 0) ThrowErrno("fcntl(F_DUPFD_CLOEXEC)");
  return UniqueFd(moved);
}

void SetNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) ThrowErrno("fcntl(O_NONBLOCK)");
}

struct Pipe {
  UniqueFd read_end;
  UniqueFd write_end;
};

// Close-on-exec from birth (pipe2, not pipe + fcntl) so that no rank, and no process another
// thread forks meanwhile, inherits a write end: a leaked write end would delay EOF forever.
Pipe MakePipe() {
  int ends[2];
  if (pipe2(ends, O_CLOEXEC) != 0) ThrowErrno("pipe2");
  Pipe pipe{UniqueFd(ends[0]), UniqueFd(ends[1])};
  pipe.read_end = AboveStdio(std::move(pipe.read_end));
  pipe.write_end = AboveStdio(std::move(pipe.write_end));
  return pipe;
}

// Writes everything or gives up silently: a closed terminal or a dead `| head` must not abort
// the job or leave the ranks orphaned, so their output is dropped instead.
void WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t written = write(fd, data, size);
    if (written > 0) {
      data += written;
      size -= static_cast<size_t>(written);
    } else if (written < 0 && errno == EINTR) {
      continue;
    } else if (written < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd writable{fd, POLLOUT, 0};
      poll(&writable, 1, -1);
    } else {
      return;
    }
  }
}

void WriteLine(int fd, std::string line) {
  line += '\n';
  WriteAll(fd, line.data(), line.size());
}

const char* SignalAbbreviation(int signo) {
  static constexpr struct {
    int signo;
    const char* name;
  } kNames[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"},
  };
  for (const auto& entry : kNames) {
    if (entry.signo == signo) return entry.name;
  }
  return nullptr;
}

std::string DescribeSignal(int signo) {
  std::string text = "signal " + std::to_string(signo);
  if (const char* name = SignalAbbreviation(signo)) text += std::string(" (") + name + ")";
  return text;
}

std::string DescribeExit(int rank, int status) {
  std::string text = "shardrl launch: rank " + std::to_string(rank);
  if (WIFEXITED(status)) return text + " exited with status " + std::to_string(WEXITSTATUS(status));
  text += " was killed by " + DescribeSignal(WTERMSIG(status));
  if (WCOREDUMP(status)) text += ", core dumped";
  return text;
}

// Shell convention, so that `shardrl launch ...; echo $?` reads like running the rank directly.
int ExitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void Validate(const LaunchOptions& options) {
  auto reject = [](const std::string& message) {
    throw std::invalid_argument("shardrl launch: " + message);
  };
  if (options.nproc < 1) reject("nproc must be at least 1, got " + std::to_string(options.nproc));
  if (options.command.empty() || options.command.front().empty()) {
    reject("command must name a program to run");
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    reject("master_port must be in [0, 65535], got " + std::to_string(options.master_port));
  }
  if (options.master_addr.empty()) reject("master_addr must not be empty");
  if (options.threads_per_rank < 0) {
    reject("threads_per_rank must be >= 0, got " + std::to_string(options.threads_per_rank));
  }
  if (!std::isfinite(options.grace_seconds) || options.grace_seconds < 0) {
    reject("grace_seconds must be a finite number >= 0");
  }
  if (options.stdout_fd < 0 || options.stderr_fd < 0) {
    reject("stdout_fd and stderr_fd must be open descriptors");
  }
}

// A free port on `address`, held by a bound socket the launcher keeps open, with SO_REUSEADDR and
// not listening, until the job ends. While it is bound, Linux gives the port to no other bind(0)
// (another launcher's pick) and to no outgoing connection's ephemeral port, yet rank 0's store,
// which binds with SO_REUSEADDR too (c10d's TCPStore, in C++ or Python), may bind and listen on
// it. torchrun closes its probe socket before the workers start; under parallel jobs another
// process took the port in that gap and rank 1 joined the wrong job's store.
struct ReservedPort {
  int port = 0;
  UniqueFd holder;
};

ReservedPort ReserveFreePort(const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  int rc = getaddrinfo(address.c_str(), "0", &hints, &found);
  if (rc != 0) {
    throw std::runtime_error("shardrl launch: cannot resolve master_addr '" + address +
                             "': " + gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addresses(found, &freeaddrinfo);
  int last_errno = EADDRNOTAVAIL;
  for (const addrinfo* candidate = found; candidate != nullptr; candidate = candidate->ai_next) {
    // Close-on-exec: the ranks must not inherit it, or the port would outlive the launcher.
    UniqueFd sock(socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC,
                         candidate->ai_protocol));
    const int reuse = 1;
    sockaddr_storage bound{};
    socklen_t bound_size = sizeof(bound);
    if (!sock.valid() ||
        setsockopt(sock.get(), SOL_SOCKET, SO_REUSEADDR, &reuse, sizeof(reuse)) != 0 ||
        bind(sock.get(), candidate->ai_addr, candidate->ai_addrlen) != 0 ||
        getsockname(sock.get(), reinterpret_cast<sockaddr*>(&bound), &bound_size) != 0) {
      last_errno = errno;
      continue;
    }
    int port = 0;
    if (bound.ss_family == AF_INET) {
      port = ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    } else if (bound.ss_family == AF_INET6) {
      port = ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port);
    } else {
      continue;
    }
    return ReservedPort{port, AboveStdio(std::move(sock))};
  }
  throw std::system_error(
      last_errno, std::generic_category(),
      "shardrl launch: cannot find a free port on master_addr '" + address + "'");
}

// Counts the CPUs this process may run on, so that `taskset` or a cpuset limits the ranks too;
// the machine-wide count would oversubscribe the allowed cores.
int UsableCores() {
#ifdef __linux__
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0 && CPU_COUNT(&allowed) > 0) {
    return CPU_COUNT(&allowed);
  }
#endif
  unsigned hardware = std::thread::hardware_concurrency();
  if (hardware > 0) return static_cast<int>(hardware);
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

// nullopt: the user chose OMP_NUM_THREADS for the job already, and that choice wins.
std::optional<int> ThreadsPerRank(const LaunchOptions& options) {
  if (options.threads_per_rank > 0) return options.threads_per_rank;
  const char* preset = std::getenv("OMP_NUM_THREADS");
  if (preset != nullptr && *preset != '\0') return std::nullopt;
  return std::max(1, UsableCores() / options.nproc);
}

std::string KeyOf(const std::string& assignment) {
  return assignment.substr(0, assignment.find('='));
}

// Built entirely before fork(): between fork and exec in a possibly multi-threaded process only
// async-signal-safe calls are allowed, so the child must not allocate.
struct ChildPlan {
  std::vector<std::string> env;
  std::vector<std::string> argv;
  std::string exec_error_prefix;
};

std::vector<char*> PointersTo(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

ChildPlan PlanRank(const LaunchOptions& options, int rank, int master_port,
                   std::optional<int> threads) {
  std::vector<std::string> settings = {
      "RANK=" + std::to_string(rank),
      "LOCAL_RANK=" + std::to_string(rank),
      "WORLD_SIZE=" + std::to_string(options.nproc),
      "LOCAL_WORLD_SIZE=" + std::to_string(options.nproc),
      "GROUP_RANK=0",
      "MASTER_ADDR=" + options.master_addr,
      "MASTER_PORT=" + std::to_string(master_port),
  };
  if (threads) {
    for (const char* key : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}) {
      settings.push_back(std::string(key) + "=" + std::to_string(*threads));
    }
  }
  std::vector<std::string> overridden;
  for (const std::string& setting : settings) overridden.push_back(KeyOf(setting));

  ChildPlan plan;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string inherited(*entry);
    if (std::find(overridden.begin(), overridden.end(), KeyOf(inherited)) == overridden.end()) {
      plan.env.push_back(std::move(inherited));
    }
  }
  plan.env.insert(plan.env.end(), settings.begin(), settings.end());
  plan.argv = options.command;
  plan.exec_error_prefix = "shardrl launch: cannot run '" + options.command.front() + "': ";
  return plan;
}

void WriteCString(int fd, const char* text) {
  WriteAll(fd, text, std::strlen(text));
}

// strerror() may translate the text, which can allocate; the forked child must not.
const char* ErrnoText(int error) {
#ifdef __GLIBC__
#if __GLIBC_PREREQ(2, 32)
  const char* text = strerrordesc_np(error);
  return text != nullptr ? text : "Unknown error";
#endif
#endif
  return std::strerror(error);
}

// Runs in the forked child, so async-signal-safe calls only.
[[noreturn]] void BecomeRank(char** argv, char** envp, const std::string& exec_error_prefix,
                             int stdin_fd, int stdout_fd, int stderr_fd) {
  // The launcher's handlers mean nothing here, and an ignored SIGPIPE would survive exec.
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  for (int signo : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) sigaction(signo, &default_action, nullptr);
  sigset_t nothing_blocked;
  sigemptyset(&nothing_blocked);
  sigprocmask(SIG_SETMASK, &nothing_blocked, nullptr);

  // A process group per rank lets one kill() reach whatever the rank spawned (shells, workers).
  setpgid(0, 0);
  // Ranks sit in background process groups, where a terminal read would stop them with SIGTTIN
  // and hang the whole job; they get /dev/null instead.
  dup2(stdin_fd, STDIN_FILENO);
  dup2(stdout_fd, STDOUT_FILENO);
  dup2(stderr_fd, STDERR_FILENO);

  environ = envp;
  execvp(argv[0], argv);
  int exec_errno = errno;
  WriteAll(STDERR_FILENO, exec_error_prefix.data(), exec_error_prefix.size());
  WriteCString(STDERR_FILENO, ErrnoText(exec_errno));
  WriteCString(STDERR_FILENO, "\n");
  _exit(kExecFailedStatus);
}

// Signal handlers are process-wide, so only one launch() at a time may own them.
std::mutex g_launch_mutex;
volatile sig_atomic_t g_wake_fd = -1;

void WakeLauncher(int signo) {
  int saved_errno = errno;
  unsigned char byte = static_cast<unsigned char>(signo);
  ssize_t ignored = write(g_wake_fd, &byte, 1);
  (void)ignored;
  errno = saved_errno;
}

// Turns SIGINT, SIGTERM and SIGCHLD into bytes on a pipe the event loop polls (the self-pipe
// trick), and ignores SIGPIPE so a vanished output reader cannot kill the launcher before it
// stops the ranks. Everything is restored when the launch ends, since the caller may be a test
// binary or any other program with its own handlers.
class SignalRelay {
 public:
  SignalRelay() : wake_(MakePipe()) {
    SetNonBlocking(wake_.read_end.get());
    // A full pipe already guarantees a wake-up, so the handler may drop bytes instead of blocking.
    SetNonBlocking(wake_.write_end.get());
    g_wake_fd = wake_.write_end.get();

    struct sigaction relay {};
    relay.sa_handler = &WakeLauncher;
    sigemptyset(&relay.sa_mask);
    relay.sa_flags = SA_RESTART;
    Install(SIGINT, relay);
    Install(SIGTERM, relay);
    // Also undoes a caller's SIG_IGN for SIGCHLD, under which the kernel would reap the ranks
    // itself and waitpid() could never report their exit status.
    relay.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    Install(SIGCHLD, relay);

    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    Install(SIGPIPE, ignore);
  }

  SignalRelay(const SignalRelay&) = delete;
  SignalRelay& operator=(const SignalRelay&) = delete;

  ~SignalRelay() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      sigaction(it->first, &it->second, nullptr);
    }
    g_wake_fd = -1;
  }

  int wake_fd() const { return wake_.read_end.get(); }

  // Returns the signals delivered since the last call, in arrival order.
  std::vector<int> TakeSignals() {
    std::vector<int> signals;
    unsigned char bytes[64];
    for (;;) {
      ssize_t got = read(wake_.read_end.get(), bytes, sizeof(bytes));
      if (got > 0) {
        signals.insert(signals.end(), bytes, bytes + got);
      } else if (got < 0 && errno == EINTR) {
        continue;
      } else {
        return signals;
      }
    }
  }

 private:
  void Install(int signo, const struct sigaction& action) {
    struct sigaction previous {};
    if (sigaction(signo, &action, &previous) != 0) ThrowErrno("sigaction");
    saved_.emplace_back(signo, previous);
  }

  Pipe wake_;
  std::vector<std::pair<int, struct sigaction>> saved_;
};

// One of a rank's output pipes, reassembled into whole lines before they are relayed.
struct OutputStream {
  UniqueFd fd;
  int sink = -1;
  std::string prefix;
  std::string partial_line;
};

enum class ReadResult { kGotData, kWouldBlock, kClosed };

// One write() per prefixed line: writes up to PIPE_BUF are atomic, so lines stay whole even when
// the sink is a pipe that other processes write to as well.
void RelayLines(OutputStream& stream, const char* data, size_t size) {
  stream.partial_line.append(data, size);
  size_t start = 0;
  for (size_t newline; (newline = stream.partial_line.find('\n', start)) != std::string::npos;
       start = newline + 1) {
    std::string line = stream.prefix;
    line.append(stream.partial_line, start, newline + 1 - start);
    WriteAll(stream.sink, line.data(), line.size());
  }
  stream.partial_line.erase(0, start);
  if (stream.partial_line.size() >= kMaxLineBytes) {
    WriteLine(stream.sink, stream.prefix + stream.partial_line);
    stream.partial_line.clear();
  }
}

void FlushPartialLine(OutputStream& stream) {
  if (stream.partial_line.empty()) return;
  WriteLine(stream.sink, stream.prefix + stream.partial_line);
  stream.partial_line.clear();
}

ReadResult ReadOnce(OutputStream& stream) {
  char buffer[64 * 1024];
  for (;;) {
    ssize_t got = read(stream.fd.get(), buffer, sizeof(buffer));
    if (got > 0) {
      RelayLines(stream, buffer, static_cast<size_t>(got));
      return ReadResult::kGotData;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return ReadResult::kWouldBlock;
    // EOF, or an error that makes the pipe as good as closed.
    FlushPartialLine(stream);
    stream.fd.Reset();
    return ReadResult::kClosed;
  }
}

// Reads what is already buffered without waiting for more. A rank's descendants may keep its
// pipes open long after the rank exited, so waiting for EOF could hang the launcher.
void ReadAvailable(OutputStream& stream) {
  while (stream.fd.valid() && ReadOnce(stream) == ReadResult::kGotData) {
  }
}

struct Rank {
  int index = 0;
  pid_t pid = -1;
  bool running = false;
  OutputStream out;
  OutputStream err;
};

class Job {
 public:
  explicit Job(const LaunchOptions& options) : options_(options), ranks_(options.nproc) {}

  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // Never leaves ranks behind, even when launching or supervising them threw.
  ~Job() {
    for (Rank& rank : ranks_) {
      if (!rank.running) continue;
      kill(-rank.pid, SIGKILL);
      int status = 0;
      while (waitpid(rank.pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }

  void Start() {
    UniqueFd dev_null(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!dev_null.valid()) ThrowErrno("open(/dev/null)");
    dev_null = AboveStdio(std::move(dev_null));

    int port = options_.master_port;
    if (port == 0) {
      reserved_port_ = ReserveFreePort(options_.master_addr);
      port = reserved_port_.port;
    }
    std::optional<int> threads = ThreadsPerRank(options_);
    for (int index = 0; index < options_.nproc; ++index) {
      StartRank(index, PlanRank(options_, index, port, threads), dev_null.get());
    }
  }

  // Returns the launch() result once every rank has been reaped.
  int Supervise() {
    while (AnyRunning()) {
      PollOnce(NextTimeoutMillis());
      ReapExited();
      EnforceDeadlines();
    }
    for (Rank& rank : ranks_) {
      for (OutputStream* stream : {&rank.out, &rank.err}) {
        ReadAvailable(*stream);
        FlushPartialLine(*stream);
        stream->fd.Reset();
      }
    }
    if (first_failure_) return *first_failure_;
    if (interrupted_by_ != 0) return 128 + interrupted_by_;
    return 0;
  }

 private:
  void StartRank(int index, ChildPlan plan, int dev_null) {
    std::vector<char*> argv = PointersTo(plan.argv);
    std::vector<char*> envp = PointersTo(plan.env);
    Rank& rank = ranks_[index];
    rank.index = index;
    std::string prefix = "[rank " + std::to_string(index) + "] ";
    Pipe out = MakePipe();
    Pipe err = MakePipe();
    SetNonBlocking(out.read_end.get());
    SetNonBlocking(err.read_end.get());
    rank.out = OutputStream{std::move(out.read_end), options_.stdout_fd, prefix, {}};
    rank.err = OutputStream{std::move(err.read_end), options_.stderr_fd, prefix, {}};

    pid_t pid = fork();
    if (pid < 0) ThrowErrno("fork");
    if (pid == 0) {
      BecomeRank(argv.data(), envp.data(), plan.exec_error_prefix, dev_null, out.write_end.get(),
                 err.write_end.get());
    }
    rank.pid = pid;
    rank.running = true;
    // Set from both sides: whichever runs first, the group exists before anyone signals it.
    // Failure here means the child already exec'ed, after making the group itself.
    setpgid(pid, pid);
  }

  bool AnyRunning() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
  }

  int NextTimeoutMillis() const {
    int timeout = kMaxPollMillis;
    for (const std::optional<Clock::time_point>& deadline : {term_at_, kill_at_}) {
      if (!deadline) continue;
      auto remaining = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now());
      timeout = static_cast<int>(
          std::clamp<std::chrono::milliseconds::rep>(remaining.count(), 0, timeout));
    }
    return timeout;
  }

  void PollOnce(int timeout_millis) {
    std::vector<pollfd> fds = {{relay_.wake_fd(), POLLIN, 0}};
    std::vector<OutputStream*> streams;
    for (Rank& rank : ranks_) {
      for (OutputStream* stream : {&rank.out, &rank.err}) {
        if (!stream->fd.valid()) continue;
        fds.push_back({stream->fd.get(), POLLIN, 0});
        streams.push_back(stream);
      }
    }
    if (poll(fds.data(), fds.size(), timeout_millis) < 0) {
      if (errno == EINTR) return;
      ThrowErrno("poll");
    }
    if (fds[0].revents != 0) {
      for (int signo : relay_.TakeSignals()) {
        if (signo == SIGINT || signo == SIGTERM) ForwardInterrupt(signo);
      }
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      if (fds[i + 1].revents != 0) ReadOnce(*streams[i]);
    }
  }

  // The ranks live in their own process groups, so a Ctrl-C at the terminal reaches only the
  // launcher; passing it on lets them shut down cleanly. Asking twice means the user is done
  // waiting.
  void ForwardInterrupt(int signo) {
    const std::string name = SignalAbbreviation(signo);
    if (interrupted_by_ == 0) {
      interrupted_by_ = signo;
      Report("received " + name + ", forwarding it to the ranks");
      SignalRunning(signo);
    } else {
      Report("received " + name + " again, killing the ranks");
      SignalRunning(SIGKILL);
    }
  }

  void ReapExited() {
    for (Rank& rank : ranks_) {
      if (!rank.running) continue;
      int status = 0;
      pid_t reaped = waitpid(rank.pid, &status, WNOHANG);
      if (reaped == 0 || (reaped < 0 && errno == EINTR)) continue;
      int wait_errno = errno;
      rank.running = false;
      // Relay the rank's last words before announcing its death, so the cause reads first.
      ReadAvailable(rank.out);
      ReadAvailable(rank.err);
      if (reaped < 0) {
        // Someone else in this process reaped it; the status is gone, so assume the worst.
        Report("rank " + std::to_string(rank.index) + " disappeared: " + std::strerror(wait_errno));
        RecordFailure(1);
      } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        WriteLine(options_.stderr_fd, DescribeExit(rank.index, status));
        RecordFailure(ExitCode(status));
      }
    }
  }

  // The survivors get a grace period because they usually notice the loss in a collective and
  // report which rank is gone, which is the message the user needs.
  void RecordFailure(int exit_code) {
    if (first_failure_) return;
    first_failure_ = exit_code;
    // Capped so that an absurd grace period cannot overflow the clock arithmetic.
    double grace_seconds = std::min(options_.grace_seconds, kMaxGraceSeconds);
    term_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(grace_seconds));
  }

  void EnforceDeadlines() {
    Clock::time_point now = Clock::now();
    if (term_at_ && now >= *term_at_) {
      term_at_.reset();
      if (AnyRunning()) {
        Report("stopping the remaining ranks with SIGTERM");
        SignalRunning(SIGTERM);
        kill_at_ = now + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(kKillAfterTermSeconds));
      }
    }
    if (kill_at_ && now >= *kill_at_) {
      kill_at_.reset();
      if (AnyRunning()) {
        Report("ranks still running after SIGTERM, sending SIGKILL");
        SignalRunning(SIGKILL);
      }
    }
  }

  // Only unreaped ranks: a reaped rank's pid may already belong to an unrelated process group.
  void SignalRunning(int signo) {
    for (const Rank& rank : ranks_) {
      if (rank.running) kill(-rank.pid, signo);
    }
  }

  void Report(const std::string& message) {
    WriteLine(options_.stderr_fd, "shardrl launch: " + message);
  }

  const LaunchOptions& options_;
  SignalRelay relay_;
  std::vector<Rank> ranks_;
  // The picked MASTER_PORT, held until the job (and this Job) ends.
  ReservedPort reserved_port_;
  std::optional<int> first_failure_;
  int interrupted_by_ = 0;
  std::optional<Clock::time_point> term_at_;
  std::optional<Clock::time_point> kill_at_;
};

}  // namespace

int launch(const LaunchOptions& options) {
  Validate(options);
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  Job job(options);
  job.Start();
  return job.Supervise();
}

}  // namespace shardrl::dist
