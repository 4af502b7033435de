// Package proxy is the data plane of a node: the listeners (outbound capture 15001, inbound
// plaintext 15006, inbound HBONE 15008, SOCKS5 15080) and, for each connection, the flow of
// resolve → authorize → dial → copy → record.
//
// It owns connection handling and drain. It does not own the wire protocol (hbone, whose
// configuration it takes as given: its caller sets hbone's hooks to an HBONEEvents), the
// workload cache (xds/state, read only), authorization rules (proxy/rbac), metric families
// (metrics) or where certificates come from: those arrive through the CertSource interface,
// so the data plane never imports the CA clients or the xDS client.
package proxy

// # Goroutines and locks
//
// Who runs what, from where a connection enters:
//
//   - Accepting: Config.Poller watches each listener (Serve). cmd/ztunnel gives every
//     proxy of a node the node's poller (internal/netpoll): on Linux one epoll set whose
//     one goroutine accepts for every listener of the node, in-pod mode's every pod
//     included; with none, netpoll.PerSocket, a goroutine per listener. The inbound
//     HBONE listener is the hbone.Server's AdmitListener, so either way handshakes past
//     the server's room wait in the kernel's backlog, and a connection from a source
//     past its budgets is refused as it is accepted, never reaching dispatch (the
//     server holds it, unread, until its handshake deadline before its RST: hbone's
//     hold.go). The poller's callback (dispatch) makes no syscall: it hands the
//     connection over.
//   - Setting up: a setup goroutine (setupLoop, tracked) tunes the socket and runs the
//     listener's handler: resolve, authorize, dial, and for 15008 the whole HBONE
//     connection (hbone.Server.ServeTLS: this goroutine becomes its frame reader; hbone
//     adds a writer and a goroutine per stream running serveHBONE). A setup goroutine
//     that finishes waits a second for its listener's next connection, so its grown stack
//     is reused.
//   - Copying (copy.go): handOff starts the copy on a fresh goroutine (copy.go says why).
//     Every connection is a TCP socket paired with an HBONE stream or with another TCP
//     socket, and one engine copies both: parkCopy. Each direction that reads a socket is
//     a pump, on a goroutine of its own: the stream pair's socket → stream, both
//     directions of the TCP pair, which splice. The other direction of a socket ↔ stream
//     pair runs on the HBONE connection's frame reader (hbone.Stream.DeliverTo), which
//     writes each DATA frame straight to the socket (in kernel TLS, splices it: kernel
//     TLS socket → pipe → socket). How a direction ends (half-close, a reset carried as a
//     reset, an abort) is copy.go's too.
//   - Parking (idle.go), where the poller parks (Poller.Parks: epoll): a pump holds no
//     goroutine while its socket is quiet, each on its own, in user-space or kernel TLS.
//     A pump's states: running (a goroutine in Stream.ReadFrom, which in kernel TLS
//     splices socket → pipe → kernel TLS socket, or in TCPConn.ReadFrom, which splices
//     socket → pipe → socket; or about to be), parked (registered one-shot,
//     EPOLLIN|EPOLLRDHUP, with the poller; no goroutine), ended. With netpoll.PerSocket a
//     pump is only ever running or ended, and nothing sweeps.
//     The sweep, a timer every 100 ms per proxy that runs only while some pump is running,
//     visits the running pumps; one seen by a sweep since it started, or by two since it
//     resumed, and then by every sweep while it moves bytes, gets a read deadline in the
//     past, which ends its ReadFrom without losing a byte (the deadline is checked before a
//     read or splice, or when one found nothing). The woken goroutine clears the deadline; if it
//     read nothing since it was last woken it parks, and returns: 100–200 ms after its
//     last byte. The poller's event (the socket is readable, half-closed, reset or failed)
//     calls Ready on the poller's goroutine, which starts a fresh goroutine that resumes
//     the pump. running → parked is the pump's own goroutine's; parked → running is
//     Ready's or unpark's, whichever takes the state first under parkCopy.mu (the other
//     then finds it running and does nothing; the poller's cancel and event race the same
//     way over its token).
//     A socket closed while registered leaves the epoll set with no event, so every close of
//     a copy's socket unparks after it: a direction's end when it aborts or resets both
//     legs (DeliverTo's callback, or the other pump's), and liveConn.close (drain deadline,
//     policy change), which unparks after closing both ends. unpark also marks the copy
//     closing, so it never parks again; the resumed goroutines find their sockets closed
//     and end their directions as unparked ones would.
//   - Completing: whichever direction ends last completes the connection (pending counts
//     them down): done, both closes and the tracker's removal run once, on the last
//     pump's goroutine, or on a fresh one when the frame reader's callback ends last. The
//     tracker's WaitGroup count is the connection's, not a goroutine's: taken by handOff,
//     given back at completion, so drain waits for parked connections and closes them at
//     its deadline like any other.
//   - Draining and policy: Shutdown closes the listeners first (they leave their
//     SO_REUSEPORT groups at once, and an accept waiting for the HBONE server's room ends),
//     then stops the poller's watches, so that every connection accepted before is
//     dispatched and served, and only then stops the tracker taking connections. The
//     tracker (track.go) waits for every goroutine it started, and every handed-off
//     connection, parked or not, and closes what is left at the drain deadline; Serve's
//     own goroutine runs the policy watcher (watchPolicies), which closes live inbound
//     connections that a policy change now denies.
//
// Locks, each guarding only its own struct's fields: tracker.mu (draining, live),
// Proxy.acceptMu (acceptFailing), Proxy.watchMu (watches),
// summaryLog.mu (the summary lines of drops, handshake failures and key limits),
// parkCopy.mu (closing, and each pump's state, sweeps, cancel), Proxy.runMu (running, the
// sweep's timer). None is held while another is taken, nor across I/O, with two
// exceptions, both in one order: parkCopy.mu is held while taking Proxy.runMu (the running
// set follows each change of state) and while registering with the poller (the epoll
// poller's mutex, and an epoll_ctl). Nothing takes them the other way: the sweep copies
// the running set under Proxy.runMu and visits each pump after releasing it, and the
// poller calls Ready with none of its locks held.
