// An OpenAI-compatible streaming server with exact, known timings, for benchmarking load clients
// (scripts/bench_replay.py compiles and runs it). autotune.sim.fixed_timing is the same instrument in Python, for
// tests; this one is C on one epoll loop so that the server, not the client, is never the bottleneck: a streamed
// token costs it one send(2).
//
//     cc -O2 -o fixed_timing_server scripts/fixed_timing_server.c
//     ./fixed_timing_server --port 8291 --ttft-ms 5 --itl-ms 5
//
// Every stream writes its first token ttft after its request was read in full and one token every itl after it,
// exactly max_tokens tokens in vLLM's SSE shapes (completion and chat), then the usage chunk and [DONE]. A timerfd
// armed at the next token's time (absolute, in nanoseconds) wakes the loop: no token is written early.
// GET /truth returns (and forgets), per x-request-id (or a number), the first token's delay as written and the
// latest any token of the stream left against its schedule (the server's own lag: the benchmark checks it).
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_FDS 65536
#define MAX_REQUEST (64 << 20)

typedef struct {
  char *in;
  size_t in_len, in_cap;
  char *out;  // what the socket would not take yet
  size_t out_len, out_cap;
  int open, streaming, chat, k, n;
  unsigned gen;     // a timer entry of an older stream on this fd is stale
  int64_t received;  // ns
  int64_t first;     // ns after received that the first token left
  int64_t late;      // ns, the latest any token left against its schedule
  char rid[128];
} Conn;

typedef struct {
  int64_t due;
  int fd;
  unsigned gen;
} Timer;

typedef struct {
  char rid[128];
  double ttft, late;
} Truth;

static Conn conns[MAX_FDS];
static Timer *heap;
static size_t heap_len, heap_cap;
static Truth *truths;
static size_t truth_len, truth_cap;
static long unnamed;
static int64_t ttft_ns, itl_ns;
static int ep, tfd;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *grow(void *p, size_t *cap, size_t need, size_t size) {
  if (need <= *cap) return p;
  size_t c = *cap ? *cap : 16;
  while (c < need) c *= 2;
  p = realloc(p, c * size);
  if (!p) { perror("realloc"); exit(1); }
  *cap = c;
  return p;
}

static void heap_push(Timer t) {
  heap = grow(heap, &heap_cap, heap_len + 1, sizeof(Timer));
  size_t i = heap_len++;
  while (i && heap[(i - 1) / 2].due > t.due) { heap[i] = heap[(i - 1) / 2]; i = (i - 1) / 2; }
  heap[i] = t;
}

static Timer heap_pop(void) {
  Timer top = heap[0], last = heap[--heap_len];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= heap_len) break;
    if (c + 1 < heap_len && heap[c + 1].due < heap[c].due) c++;
    if (heap[c].due >= last.due) break;
    heap[i] = heap[c];
    i = c;
  }
  if (heap_len) heap[i] = last;
  return top;
}

static void arm(void) {
  struct itimerspec its = {0};
  if (heap_len) {
    its.it_value.tv_sec = heap[0].due / 1000000000;
    its.it_value.tv_nsec = heap[0].due % 1000000000;
    if (!its.it_value.tv_sec && !its.it_value.tv_nsec) its.it_value.tv_nsec = 1;
  }
  timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
}

static void close_conn(int fd) {
  Conn *c = &conns[fd];
  epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
  close(fd);
  free(c->in);
  free(c->out);
  unsigned gen = c->gen + 1;
  memset(c, 0, sizeof(*c));
  c->gen = gen;
}

static void watch_out(int fd, int on) {
  struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.fd = fd};
  epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev);
}

// Send what is queued, then data; queue what the socket does not take. 0, or -1 when the connection is gone.
static int put(int fd, const char *data, size_t len) {
  Conn *c = &conns[fd];
  if (!c->out_len) {
    ssize_t w = send(fd, data, len, MSG_NOSIGNAL);
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    if (w < 0) w = 0;
    data += w;
    len -= (size_t)w;
    if (!len) return 0;
    watch_out(fd, 1);
  }
  c->out = grow(c->out, &c->out_cap, c->out_len + len, 1);
  memcpy(c->out + c->out_len, data, len);
  c->out_len += len;
  return 0;
}

static int flush_out(int fd) {
  Conn *c = &conns[fd];
  while (c->out_len) {
    ssize_t w = send(fd, c->out, c->out_len, MSG_NOSIGNAL);
    if (w < 0) return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    memmove(c->out, c->out + w, c->out_len - (size_t)w);
    c->out_len -= (size_t)w;
  }
  watch_out(fd, 0);
  return 0;
}

static int put_chunk(int fd, const char *data, size_t len) {
  char head[32];
  int h = snprintf(head, sizeof head, "%zx\r\n", len);
  char *buf = malloc((size_t)h + len + 2);
  memcpy(buf, head, (size_t)h);
  memcpy(buf + h, data, len);
  memcpy(buf + h + len, "\r\n", 2);
  int r = put(fd, buf, (size_t)h + len + 2);
  free(buf);
  return r;
}

static int put_json(int fd, int status, const char *body) {
  char head[160];
  int h = snprintf(head, sizeof head,
                   "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n", status,
                   status == 200 ? "OK" : "Not Found", strlen(body));
  return put(fd, head, (size_t)h) < 0 ? -1 : put(fd, body, strlen(body));
}

static void remember(Conn *c) {
  truths = grow(truths, &truth_cap, truth_len + 1, sizeof(Truth));
  Truth *t = &truths[truth_len++];
  if (c->rid[0]) snprintf(t->rid, sizeof t->rid, "%s", c->rid);
  else snprintf(t->rid, sizeof t->rid, "unnamed-%ld", unnamed++);
  t->ttft = (double)c->first / 1e9;
  t->late = (double)c->late / 1e9;
}

static int send_truth(int fd) {
  size_t cap = 64 + truth_len * 200, len = 0;
  char *body = malloc(cap);
  len += (size_t)snprintf(body + len, cap - len, "{");
  for (size_t i = 0; i < truth_len; i++)
    len += (size_t)snprintf(body + len, cap - len, "%s\"%s\":{\"ttft\":%.9f,\"late\":%.9f}", i ? "," : "",
                            truths[i].rid, truths[i].ttft, truths[i].late);
  snprintf(body + len, cap - len, "}");
  truth_len = 0;
  int r = put_json(fd, 200, body);
  free(body);
  return r;
}

// The stream's next token, at its time; the usage chunk, [DONE] and the last chunk after the last token.
static int token(int fd, int64_t now) {
  Conn *c = &conns[fd];
  int64_t due = c->received + ttft_ns + (int64_t)c->k * itl_ns;
  if (now - due > c->late) c->late = now - due;
  const char *object = c->chat ? "chat.completion.chunk" : "text_completion";
  const char *finish = c->k == c->n - 1 ? "\"length\"" : "null";
  char choice[160], event[400];
  if (c->chat)
    snprintf(choice, sizeof choice, "{\"index\":0,\"delta\":%s,\"finish_reason\":%s}",
             c->k == 0 ? "{\"role\":\"assistant\",\"content\":\"\"}" : "{\"content\":\" tok\"}", finish);
  else
    snprintf(choice, sizeof choice, "{\"index\":0,\"text\":\" tok\",\"finish_reason\":%s}", finish);
  int e = snprintf(event, sizeof event,
                   "data: {\"id\":\"x\",\"object\":\"%s\",\"model\":\"fixed-timing\",\"choices\":[%s]}\n\n", object,
                   choice);
  if (c->k == 0) {
    c->first = now - c->received;
    static const char head[] =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    if (put(fd, head, sizeof head - 1) < 0) return -1;
  }
  if (put_chunk(fd, event, (size_t)e) < 0) return -1;
  c->k++;
  if (c->k < c->n) {
    heap_push((Timer){c->received + ttft_ns + (int64_t)c->k * itl_ns, fd, c->gen});
    return 0;
  }
  e = snprintf(event, sizeof event,
               "data: {\"id\":\"x\",\"object\":\"%s\",\"model\":\"fixed-timing\",\"choices\":[],\"usage\":"
               "{\"prompt_tokens\":1,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\ndata: [DONE]\n\n",
               object, c->n, c->n + 1);
  if (put_chunk(fd, event, (size_t)e) < 0 || put(fd, "0\r\n\r\n", 5) < 0) return -1;
  remember(c);
  c->streaming = 0;
  c->gen++;
  return 1;
}

static const char *header(const char *head, size_t len, const char *name) {
  size_t n = strlen(name);
  for (const char *p = head; p && p < head + len; p = memchr(p, '\n', (size_t)(head + len - p))) {
    if (*p == '\n') p++;
    if ((size_t)(head + len - p) > n && !strncasecmp(p, name, n) && p[n] == ':') {
      p += n + 1;
      while (*p == ' ') p++;
      return p;
    }
  }
  return NULL;
}

// Handle every whole request in the connection's buffer (one at a time: a stream holds the connection).
static int serve(int fd) {
  Conn *c = &conns[fd];
  while (!c->streaming) {
    char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
    if (!end) return c->in_len > MAX_REQUEST ? -1 : 0;
    size_t head_len = (size_t)(end - c->in) + 4;
    const char *cl = header(c->in, head_len, "content-length");
    size_t body_len = cl ? strtoul(cl, NULL, 10) : 0;
    if (head_len + body_len > MAX_REQUEST) return -1;
    if (c->in_len < head_len + body_len) return 0;
    int64_t received = now_ns();
    int get = !strncmp(c->in, "GET ", 4);
    char *path = memchr(c->in, ' ', head_len);
    if (!path) return -1;
    path++;
    int r = 0;
    if (get && !strncmp(path, "/truth ", 7)) r = send_truth(fd);
    else if (get && !strncmp(path, "/v1/models ", 11))
      r = put_json(fd, 200, "{\"object\":\"list\",\"data\":[{\"id\":\"fixed-timing\",\"object\":\"model\"}]}");
    else if (get) r = put_json(fd, 200, "{}");
    else if (!strncmp(path, "/v1/completions ", 16) || !strncmp(path, "/v1/chat/completions ", 21)) {
      c->chat = !strncmp(path, "/v1/chat/", 9);
      char *body = c->in + head_len, saved = body[body_len];
      body[body_len] = 0;  // the buffer always has a byte to spare (in_cap > in_len)
      char *mt = strstr(body, "\"max_tokens\"");
      body[body_len] = saved;
      c->n = 16;
      if (mt) {
        mt += 12;
        while (*mt == ' ' || *mt == ':') mt++;
        if (isdigit((unsigned char)*mt)) c->n = atoi(mt);
      }
      if (c->n < 1) c->n = 1;
      const char *rid = header(c->in, head_len, "x-request-id");
      c->rid[0] = 0;
      if (rid) {
        size_t i = 0;
        while (i < sizeof c->rid - 1 && rid[i] != '\r' && rid[i] != '\n' && rid[i] != '"' && rid[i] != '\\') {
          c->rid[i] = rid[i];
          i++;
        }
        c->rid[i] = 0;
      }
      c->received = received;
      c->k = 0;
      c->late = 0;
      c->streaming = 1;
      heap_push((Timer){received + ttft_ns, fd, c->gen});
    } else
      r = put_json(fd, 404, "{\"error\":\"not found\"}");
    memmove(c->in, c->in + head_len + body_len, c->in_len - head_len - body_len);
    c->in_len -= head_len + body_len;
    if (r < 0) return -1;
  }
  return 0;
}

static void on_readable(int fd) {
  Conn *c = &conns[fd];
  for (;;) {
    c->in = grow(c->in, &c->in_cap, c->in_len + 65537, 1);
    ssize_t r = recv(fd, c->in + c->in_len, c->in_cap - c->in_len - 1, 0);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      close_conn(fd);
      return;
    }
    if (r < 0) break;
    c->in_len += (size_t)r;
  }
  if (serve(fd) < 0) close_conn(fd);
}

static const char *flag(int argc, char **argv, const char *name, const char *fallback) {
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i] + 2, name) && !strncmp(argv[i], "--", 2)) return argv[i + 1];
  return fallback;
}

int main(int argc, char **argv) {
  const char *host = flag(argc, argv, "host", "127.0.0.1");
  int port = atoi(flag(argc, argv, "port", "8291"));
  ttft_ns = (int64_t)(atof(flag(argc, argv, "ttft-ms", "5")) * 1e6);
  itl_ns = (int64_t)(atof(flag(argc, argv, "itl-ms", "5")) * 1e6);
  signal(SIGPIPE, SIG_IGN);
  int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  if (inet_pton(AF_INET, host, &addr.sin_addr) != 1 || bind(ls, (struct sockaddr *)&addr, sizeof addr) < 0 ||
      listen(ls, 4096) < 0) {
    fprintf(stderr, "fixed_timing_server: cannot listen on %s:%d: %s\n", host, port, strerror(errno));
    return 1;
  }
  ep = epoll_create1(0);
  tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls};
  epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
  ev.data.fd = tfd;
  epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev);
  struct epoll_event events[256];
  for (;;) {
    int n = epoll_wait(ep, events, 256, -1);
    for (int i = 0; i < n; i++) {
      int fd = events[i].data.fd;
      if (fd == ls) {
        int cfd;
        while ((cfd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
          if (cfd >= MAX_FDS) { close(cfd); continue; }
          setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          conns[cfd].open = 1;
          struct epoll_event cev = {.events = EPOLLIN, .data.fd = cfd};
          epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &cev);
        }
      } else if (fd == tfd) {
        uint64_t fired;
        if (read(tfd, &fired, sizeof fired) < 0 && errno != EAGAIN) perror("timerfd");
      } else if (conns[fd].open) {
        if ((events[i].events & EPOLLOUT) && flush_out(fd) < 0) { close_conn(fd); continue; }
        if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(fd);
      }
    }
    int64_t now;
    while (heap_len && heap[0].due <= (now = now_ns())) {
      Timer t = heap_pop();
      Conn *c = &conns[t.fd];
      if (!c->open || !c->streaming || c->gen != t.gen) continue;  // closed, or a cut stream's old timer
      int r = token(t.fd, now);
      if (r < 0) close_conn(t.fd);
      else if (r > 0 && serve(t.fd) < 0) close_conn(t.fd);  // a request that came while this one streamed
    }
    arm();
  }
}
