// Package hbone is the HBONE wire: HTTP/2 CONNECT tunnels over mutual TLS, as spoken by
// Istio's ztunnel, waypoints and east-west gateways. It is usable on its own, in any Go
// program that dials or serves HBONE: it knows nothing of xDS, workloads or where
// certificates come from (the caller hands it a *tls.Config); of this module it imports
// only the SPIFFE ID type (package identity) and two internal helpers (kernel TLS,
// goroutine reuse). The package example opens a stream through a Pool to a Server, both
// with SPIFFE identities over mTLS.
//
// It owns the client side (Pool: connections pooled per source identity, expected peer
// identities, address and source IP; one dial in flight per key; idle eviction; GOAWAYed
// connections never reused; a CONNECT left unanswered by a refusal or by a pooled
// connection breaking under it retried on another), the server side (Server: each CONNECT stream handed to a
// Handler with the peer's verified identity), streams that behave like TCP connections
// (half-close with END_STREAM, abort with RST_STREAM, deadlines), PING keepalive and
// GOAWAY drain. It does not make certificates or decide policy: *tls.Config comes from
// the caller, and the handler decides 200/401/503.
//
// # Wire format
//
// TCP to port 15008, TLS 1.3 with ALPN "h2", then RFC 9113 HTTP/2. One TCP connection
// proxied = one stream:
//
//	HEADERS  :method=CONNECT :authority=10.0.0.5:8080 baggage=... forwarded=for="..." traceparent=...
//	HEADERS  :status=200 [baggage=...]          (anything else: the tunnel failed)
//	DATA ... DATA(END_STREAM)                    each direction independently (half-close)
//	RST_STREAM(CANCEL)                            abort; from the peer before its END_STREAM, a read error
//	RST_STREAM(CONNECT_ERROR)                     Stream.Reset: the proxy's TCP peer reset (RFC 9113 §8.5)
//
// Defaults follow the Rust ztunnel: 4 MiB stream and 16 MiB connection windows, 1 MiB
// frames, 100 streams per pooled client connection, 200 advertised by the server, PING
// every 10 s with a 20 s timeout.
//
// # Why our own connection loop on x/net/http2's Framer
//
// net/http's HTTP/2 server cannot send END_STREAM while still reading the request body,
// so it cannot half-close a CONNECT tunnel, and its layering costs were measured at about
// 2.4 CPU-seconds per GB more than Go's TLS alone (docs/PERFORMANCE.md). This package
// drives golang.org/x/net/http2's Framer and hpack directly:
//
//   - One frame reader per connection delivers DATA: when the stream's consumer is a
//     WriteTo into a *net.TCPConn with nothing queued, it writes the payload straight to
//     that socket with one non-blocking write(2) (no copy, no goroutine hand-off);
//     otherwise it copies it into the stream's queue of pooled chunks. Neither allocates.
//     The reader never blocks on the socket's write side: the control frames it must
//     send are queued for the connection's writer goroutine (which also runs PING and
//     idle timers), so two peers sending bulk data at each other cannot deadlock.
//   - Writers (the goroutine that read the TCP socket) write their own DATA frames, large
//     ones (reads grow to 1 MiB), under one write lock; on the client (and ServeTLS) a
//     buffering layer under crypto/tls collects records and is flushed when the last
//     queued writer releases the lock, so a batch of frames costs one write(2).
//     Over that layer a DATA frame's 9-byte header is its own tiny TLS record so the
//     payload is encrypted straight from the caller's buffer. A caller-made *tls.Conn
//     (ServeConn) cannot be wrapped, so ServeTLS exists for servers that want this.
//   - WINDOW_UPDATEs are batched: sent once a quarter of a window has been consumed.
//     Capacity is returned when the consumer takes the data, so a reader that stops
//     reading stops its peer after one stream window, and memory stays bounded by it.
//     Data dropped by a Close, a reset or a rejection is released too, and a DATA frame
//     that loses the race to its stream's RST_STREAM gives its window back: a window
//     leaked on every aborted stream would stall the whole connection in the end
//     (TestAbortsKeepWindowsWhole checks that both ends' windows add up).
//
// # Kernel TLS
//
// On the connections whose handshake this package runs (Pool's dials, ServeTLS), the
// kernel is asked first (ktls.Available installs the TLS ULP, which leaves the socket
// plain TCP until keys arrive). If it has kernel TLS (tls.ko), the handshake goes through
// internal/ktls, and after it (and the ALPN check) the record layer moves to the kernel
// if it also has the cipher suite; Config.DisableKernelTLS turns this off, and FIPS 140-3
// mode does (internal/ktls refuses with "fips": records stay in Go's module). Where it
// cannot, the connection runs in crypto/tls as before (from its start, when the kernel
// said no before the handshake), and Config.OnTLS hears why in one word (no_kernel_tls,
// cipher, ...); a kernel that refused the ULP is not asked again for a minute (each
// refusal can run modprobe). In kernel TLS:
//
//   - Stream.ReadFrom from a TCP socket splices each DATA payload socket → pipe → kernel
//     TLS socket: it waits for data with no pipe held, fills a pipe from a small shared
//     free list, reserves window for what the pipe holds, then under the write lock
//     writes the buffered frames and the 9-byte header with MSG_MORE (one record with
//     the payload) and splices the payload after it. Other writes go to a coalescing
//     buffer over the socket; a large payload from user space joins it in one writev(2).
//   - The frame reader reads each frame header itself (kread.go), exactly, never into
//     the next payload. A DATA frame for a stream under DeliverTo with nothing queued
//     it splices kernel TLS socket → pipe → the TCP socket, as long as that socket takes
//     it without waiting; the rest of the frame goes to the stream's queue, as
//     writeDirectLocked's does. Every other frame goes to the Framer as before.
//   - Stream.KernelTLSBytes counts DATA payload bytes spliced and copied each way.
//   - File descriptors: each connection's frame reader keeps a pipe (two), and a stream
//     borrows one from the free list only while it sends.
//
// Kernel TLS here follows no KeyUpdate, so only a connection whose peer promised never to
// send one moves to it: the peer negotiated NextProtoNoKeyUpdate ("gozt-h2", HTTP/2 from
// gozt) rather than "h2" (the Rust ztunnel's rustls sends KeyUpdates); every other
// connection stays in crypto/tls, which follows them, with TLSInfo.Reason
// "peer_may_update_keys", and reads as one that never tried kernel TLS (its handshake's
// record-by-record reads end: ktls.Handoff.Decline). A KeyUpdate that arrives anyway
// ends the connection (its streams fail; the pool dials a new one); so does any alert.
// closeWith closes the socket, not the kernel TLS conn, whose close_notify would bypass
// the write lock. A kernel TLS connection also counts the records it receives (the
// kernel's sequence number) and drains (below).
//
// # Key limits
//
// No TLS stack under this package rekeys by itself: crypto/tls sends no KeyUpdate of its
// own, kernel TLS here neither sends nor follows one. So each connection counts the records
// its keys protected (keylimit.go) and drains at Config.KeyDrainRecords (default half of
// what rustls, the Rust ztunnel's TLS, rekeys at: 2^22 records on AES-256-GCM, 2^23 on
// AES-128-GCM), sent records on every path, received ones under kernel TLS (where a
// KeyUpdate from a peer that broke its promise would end the connection) and on TLS 1.2:
// a server sends GOAWAY, a client leaves the pool, new streams go to a fresh connection,
// the open ones finish. A stream that outlives the drain fails with ErrConnClosed at
// KeyMaxRecords sent (RFC 8446 §5.5's 2^24.5) or at such a KeyUpdate, never with a clean
// EOF, and Config.OnKeyLimit hears of it. On the user-space path a peer's
// KeyUpdate is followed by crypto/tls, and its answer to update_requested leaves at once
// (bufConn writes through when the write lock is not held) and starts the sent count
// again: the limits are per key.
//
// # Limits
//
// Port 15008 is reachable by every workload in the mesh, so a peer with a valid
// certificate is not a trusted one. Before these limits, one connection opening streams
// and resetting each at once (HTTP/2 rapid reset, CVE-2023-44487) had a node dial about
// 80,000 backends a second and grow to 500 MB. Every limit applies to both sides of a
// connection unless it says "server".
//
//   - Streams and handlers (server): at most MAX_CONCURRENT_STREAMS (200) streams are
//     open, and a new one past that gets RST_STREAM(REFUSED_STREAM). At most as many
//     handlers run at once, however early the peer reset their streams: when all are
//     busy, a new stream waits for one to return, as net/http does since that CVE
//     (refusing it instead would refuse an honest client whose closed streams' handlers
//     are still finishing). So handler goroutines and backend sockets stay within the
//     limit per connection, whatever the peer resets.
//   - Early resets (server): a stream refused, or reset by the peer before the handler
//     answered it, spends a token of a per-connection budget: 2 × the stream limit at
//     once, then 100 a second. A peer that runs out gets GOAWAY(ENHANCE_YOUR_CALM) (a
//     calm close, below). (The h2 crate, the Rust ztunnel's, counts the same streams as
//     max_pending_accept_reset_streams, 20 at a time; a rate also catches a peer whose
//     resets our handlers keep up with.) The reset ends the Request's context at once,
//     so the handler's dial stops, and Config.OnDrop hears of each such stream so the
//     caller can count them rather than log each.
//   - Stream starts (server): StreamStarts (64 a second, a burst of 16) handlers start on
//     one connection, each start given back once its stream carries a byte either way,
//     or ends however it ends (a 5xx or a denial, a reset, a close); past it a new stream
//     waits in the connection's queue with no goroutine (the peer's window and socket
//     hold the rest), so a peer that opens streams to a live backend and never uses them
//     is set up no faster than that, while an honest client, whose streams carry bytes
//     within a round trip, never waits for it. Per connection, not per identity: a
//     deployment's pods share an identity, and one of them flooding must not hold its
//     siblings' streams back (each reconnect is held to PeerConnRate instead). The queue
//     is first in, first out. Only streams that are open and silent hold starts, so a
//     burst of used streams delays the later ones by its own round trips (16 a round
//     trip), and only a burst of silent ones by the refill. Another order would not be
//     fairer: a ztunnel pools a connection per client pod (in-pod mode), so the burst and
//     the streams behind it are the same pod's, whose order is kept; where one connection
//     carries many clients (a waypoint's), telling them apart means trusting a header the
//     peer writes, and newest-first or random starves the oldest.
//   - Junk frames: frames that make us work but carry nothing — PING, SETTINGS,
//     PRIORITY, empty DATA, WINDOW_UPDATE under 1 KiB, RST_STREAM or HEADERS for a
//     stream already gone, unknown frame types, 1xx responses — spend a second budget: 1000 at once, then 100 a
//     second; past it, GOAWAY(ENHANCE_YOUR_CALM). Keepalive PINGs come every 10 s.
//   - Owed control frames (acks, RST_STREAM, WINDOW_UPDATE) queue for the writer: at
//     most 10,000 (Go's net/http and nghttp2 use the same), then the connection closes.
//   - Handshakes (server): at most MaxHandshakes (1024) connections are in their TLS
//     handshake (and preface) at once, each for at most DialTimeout (10 s); past the limit
//     the oldest is closed. A connection that never starts TLS or stalls halfway
//     (slowloris) is the oldest, while an honest handshake takes milliseconds, so a
//     flood of them delays no honest client; each costs about 6.5 KiB of heap, a
//     goroutine and a socket until then. An evicted handshake waiting for the CPU (the
//     gate, below) stops waiting at once. The accept loops (Server.Serve, the proxy's
//     on 15008, the node-wide poller of in-pod mode's pod listeners) take connections
//     through the Server's AdmitListener (admit.go): past 2 × MaxHandshakes connections
//     not yet serving HTTP/2 (those in their handshake and the evicted on their way
//     out), and until the goroutine of the last one accepted has started, the rest wait
//     in the kernel's backlog, so goroutines stay bounded however fast a flood comes.
//     They do not stop for handshakes queued for the CPU: that would make the backlog
//     first-come first-served, every queued ClientHello would get its key exchange, and
//     a full backlog drops SYNs (an honest client then retries after a second), where
//     eviction sheds the oldest unserved and lets the newest in.
//   - Per-node budgets (server, admission.go): the limits above are per connection, so a peer
//     with N connections would get N times them, and a reconnect after each
//     ENHANCE_YOUR_CALM buys a fresh handshake (~0.7 ms of CPU) per cycle. These hold
//     across a Server's connections; a zero AdmissionConfig field is the default, a negative one
//     turns the budget off (the ztunnel binary sets them from its HBONE_* variables,
//     docs/CONFIGURATION.md). Each refusal or wait goes to Config.OnDrop with its reason.
//     Before the handshake, by source IP (nothing is read from a refused connection: it
//     gets an RST, no key exchange and no TIME_WAIT):
//     SourceHandshakes (256) in flight, then refused; SourceHandshakeRate (32/s, a burst
//     of 256) new connections, past it one waits up to 1 s for the next token, then is
//     refused; SourceFailedHandshakes (2/s, a burst of 16: a client retrying through a
//     certificate rotation) failures (TLS error, wrong ALPN, no preface, handshake
//     deadline, evicted), and while past it every connection from the source is refused.
//     In Istio ambient's in-pod mode the source of an HBONE connection is the client
//     pod's address, so one pod's storm does not slow its node's other pods. But in node
//     mode, or with many pods behind one address (NAT), every identity of a node comes
//     from one IP, and a node that restarts reconnects them all at once: one connection
//     per identity with traffic to us, up to the node's pods (Kubernetes' max-pods is
//     110 by default, 250 at most on most providers). So the in-flight cap and the burst
//     are a node's worth, 256, and a handshake that succeeds gives its rate token back:
//     the rate binds a source whose handshakes fail, stall or end in a calm close (whose
//     penalty is a debt on the same bucket), never a node whose identities are all
//     valid. Each identity is still held to PeerConnRate, which is where a source with
//     valid certificates that churns connections is slowed. (Measured here: 200
//     identities from one IP, all at once, each get a connection and an answered stream
//     in 0.65 s with the defaults, none refused; with the earlier 64 in flight, 127 to 135
//     of them were refused.) A network gateway's address is the exception: it relays many
//     clients' double HBONE, so AdmissionConfig.SourceRelays exempts it from these and from
//     PeerConnRate below (the proxy names every gateway its workloads name).
//     After the handshake, by peer identity (connections without one, h2c, are not
//     counted): PeerConnRate (32/s, a burst of 128) new connections, past it one waits up
//     to 1 s, then is closed; PeerStreams (16384) open streams, past it a new one gets
//     REFUSED_STREAM (and spends the early-reset budget) — sized for fan-in, not for one
//     client: every pod of a deployment shares its identity, and thousands of them holding
//     a few pooled connections each to one database pod is ordinary (the Rust ztunnel has
//     no such limit), while 16384 proxied connections are a few percent of what a node's
//     descriptors allow; PeerDials (256)
//     streams whose handler has not answered (a backend dial, in a proxy), past it a new
//     one waits for one to answer, so a peer that floods CONNECTs to a live backend holds
//     at most that many dials, whatever its number of connections. Keyed by identity, a
//     budget is shared by every client of that identity: an honest one of the same
//     identity waits too, another identity never does. At most HandshakeWorkers
//     (GOMAXPROCS-1, at least one) ServeTLS handshakes compute at once: a handshake holds
//     its place only between its reads, so one stalled by its peer holds none, and one P
//     is always left to established connections. Per-source and per-identity entries are
//     forgotten once idle with full buckets, swept when their number passes 4096.
//   - Calm close (server): a peer that runs out of a budget gets GOAWAY(ENHANCE_YOUR_CALM)
//     naming the last stream processed, and the connection drains rather than closes:
//     new streams get REFUSED_STREAM, the open ones finish within 10 s, then it closes. A
//     pooled connection carries every client of one identity to this node, so a close
//     would cut the honest streams beside the flood. The peer gets one more burst of the
//     budget it ran out of, and a PING after the GOAWAY: until it acks that PING (it has
//     read the GOAWAY) up to 8 new streams are refused, what it may have sent meanwhile;
//     past either, on any new stream after the ack, or if it does not read what we owe
//     it, it is closed at once. Our Pool takes the connection out of the pool at the GOAWAY, so
//     new streams dial a fresh one while the old ones finish.
//   - Header blocks: 64 KiB decoded on the server, 16 KiB on the client (x/net's Framer
//     enforces it across CONTINUATION frames); frames up to MaxFrameSize.
//   - A hostile server can do no more to the client: it gets the same frame budgets,
//     PUSH_PROMISE is a connection error, a refused CONNECT is retried at most twice, and
//     Dial's context bounds how long an unanswered CONNECT waits.
//
// # Locks
//
// Taken in this order, never the other way: Pool.mu → conn.mu; Stream.wmu → conn.wmu →
// conn.mu; Stream.rmu → conn.mu. Server.mu is never held with a conn's lock, nor
// admission.mu (admission.go) with any other. conn.wmu
// (the write lock: the Framer's write side, the HPACK encoder, the coalescing buffer)
// is held by whoever writes frames; functions that need it end in WLocked. conn.mu (the
// state lock: streams, windows, settings, the control-frame queue) guards the rest of
// conn and Stream's fields marked so; functions that need it end in Locked. The frame
// reader owns the Framer's read side alone.
//
// Goroutines: per connection one frame reader and one writer (owned by the Pool, or by
// the ServeConn call), plus one per server stream running the Handler. Stream.DeliverTo
// is WriteTo without a waiting goroutine: the frame reader's direct writes carry the
// data, and a short-lived goroutine starts only when the socket is full (or the stream
// ends with data still queued), so a proxy needs one goroutine per proxied connection,
// not two. A handler goroutine whose stream ended waits up to a second to run the
// connection's next stream, so its grown stack is reused. Pool.Close and ServeConn
// return only after all of theirs, drains included, have exited.
//
// # Files
//
// The API: client.go (Pool, Dial), server.go (Server, Handler, Request, Serve, ServeConn,
// ServeTLS, Shutdown), stream.go (Stream: Read/Write, half-close, reset, deadlines),
// deliver.go (the receive side handed to a consumer: WriteTo, DeliverTo), readfrom.go (the
// send side fed from a reader: ReadFrom), config.go (Config, what both sides use, and
// ClientConfig, ServerConfig and AdmissionConfig around it, their defaults, Key, TLSInfo,
// KernelTLSBytes, DropReason), errors.go (StatusError, ResetError, GoAwayError, the
// connection errors). Below it, by direction:
//
//   - conn.go: one connection's lifecycle (newConn, closeWith) and its fields, grouped by
//     the lock or goroutine that owns them.
//   - write.go: the write side (the write lock, control frames queued for writeLoop,
//     DATA and HEADERS frames); buf.go: the pooled buffers and the coalescing bufConn.
//   - read.go: the frame reader (readLoop) and what each frame does.
//   - trim.go: a connection that carried bulk data gives its large buffers (the read
//     Framer's, the coalescing buffer) back once idle for half a second to a second.
//   - keylimit.go: draining a connection before its TLS keys' record limit.
//   - flow.go: windows and SETTINGS; limits.go: what a peer may make a connection do;
//     admission.go: what a source IP or a peer identity may make the whole server do.
//   - Kernel TLS: ktls.go (the handshake, the move to the kernel, the fallback, what a
//     connection reports), ksend.go (the send side: writev and the splice into the
//     socket, the pipes' free list), kread.go (the receive side: the frame reader's
//     source, the splice out to a DeliverTo socket).
package hbone
