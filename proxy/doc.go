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
//   - Accepting: an Acceptor watches each listener (Serve). In-pod mode's pod proxies
//     share the node-wide poller (internal/podpoll), which accepts for every pod from one
//     goroutine; every other proxy gets goAcceptor, a goroutine per listener
//     (accept.go). The inbound HBONE listener is the hbone.Server's AdmitListener, so
//     either way handshakes past the server's room wait in the kernel's backlog. The
//     Acceptor's callback (dispatch) makes no syscall: it hands the connection over.
//   - Setting up: a setup goroutine (setupLoop, tracked) tunes the socket and runs the
//     listener's handler: resolve, authorize, dial, and for 15008 the whole HBONE
//     connection (hbone.Server.ServeTLS: this goroutine becomes its frame reader; hbone
//     adds a writer and a goroutine per stream running serveHBONE). A setup goroutine
//     that finishes waits a second for its listener's next connection, so its grown stack
//     is reused.
//   - Copying: handOff starts the copy on a fresh goroutine (copy.go says why), which
//     copies the client's socket into the HBONE stream or the plain leg. The other
//     direction of a socket ↔ HBONE stream pair runs on the HBONE connection's frame
//     reader (hbone.Stream.DeliverTo), which writes each DATA frame straight to the
//     socket (in kernel TLS, splices it: kernel TLS socket → pipe → socket); plain TCP ↔
//     TCP pairs copy each way on a goroutine of its own and splice.
//   - Parking (idle.go): a socket ↔ stream pair, in user-space or kernel TLS (both nodes:
//     the client node's client socket → stream, the server node's backend socket →
//     stream), and a TCP ↔ TCP pair (passthrough, plaintext inbound) are a parkCopy, whose
//     directions that read a socket (pumps: the stream pair's socket → stream, both of the
//     TCP pair's) hold no goroutine while their socket is quiet, each on its own. A pump's
//     states: running (a goroutine in Stream.ReadFrom, which in kernel TLS splices socket
//     → pipe → kernel TLS socket, or in TCPConn.ReadFrom, which splices socket → pipe →
//     socket; or about to be), parked (registered one-shot, EPOLLIN|EPOLLRDHUP, with the
//     idle poller; no goroutine), ended.
//     The sweep, a timer every 100 ms per proxy that runs only while some pump is running,
//     visits the running pumps; one seen by two sweeps since it started or resumed, and
//     then by every sweep while it moves bytes, gets a read deadline in the past, which
//     ends its ReadFrom without losing a byte (the deadline is checked before a read or
//     splice, or when one found nothing). The woken goroutine clears the deadline; if it
//     read nothing since it was last woken it parks, and returns: 100–200 ms after its
//     last byte. The poller's event (the socket is readable, half-closed, reset or failed)
//     calls ready on the poller's goroutine, which starts a fresh goroutine that resumes
//     the pump. running → parked is the pump's own goroutine's; parked → running is
//     ready's or unpark's, whichever takes the state first under parkCopy.mu (the other
//     then finds it running and does nothing; podpoll's cancel and event race the same way
//     over its token).
//     A socket closed while registered leaves the epoll set with no event, so every close of
//     a copy's socket unparks after it: a direction's end when it aborts or resets both
//     legs (DeliverTo's callback, or the other pump's), and liveConn.close (drain deadline,
//     policy change), whose last closer is the parkCopy. unpark also marks the copy
//     closing, so it never parks again; the resumed goroutines find their sockets closed
//     and end their directions as unparked ones would.
//     Whichever direction ends last completes the connection (pending counts them down):
//     done, both closes and the tracker's removal run once, on the last pump's goroutine,
//     or on a fresh one when the frame reader's callback ends last. The tracker's
//     WaitGroup count is the connection's, not a goroutine's: taken by handOff, given back
//     at completion, so drain waits for parked connections and closes them at its deadline
//     like any other.
//     The idle poller is Config.IdlePoller (in-pod mode: the node's internal/podpoll
//     poller, owned and closed by inpod/podproxy after every pod has stopped), else the
//     proxy's own podpoll poller, started at the first park and closed by Shutdown after
//     every connection has completed (a proxy that is never shut down keeps its goroutine).
//   - Draining and policy: Shutdown closes the listeners first (they leave their
//     SO_REUSEPORT groups at once), then stops the Acceptor's watches, so that every
//     connection accepted before is dispatched and served, and only then stops the tracker
//     taking connections. The tracker (track.go) waits for every goroutine it started,
//     and every handed-off connection, parked or not, and closes what is left at the drain
//     deadline; Serve's own goroutine runs the policy
//     watcher (watchPolicies), which closes live inbound connections that a policy change
//     now denies.
//
// Locks, each guarding only its own struct's fields: tracker.mu (draining, live),
// liveConn.mu (its closers), Proxy.acceptMu (acceptFailing), Proxy.watchMu (watches),
// summaryLog.mu (the summary
// lines of drops, handshake failures and key limits), parkCopy.mu (closing, and each
// pump's state, sweeps, cancel), Proxy.runMu (running, the sweep's timer), Proxy.idleMu
// (the proxy's own poller). None is held while another is taken, nor across I/O, with two
// exceptions, both in one order: parkCopy.mu is held while taking Proxy.runMu (the running
// set follows each change of state) and while registering with the poller (podpoll's
// Poller.mu, and an epoll_ctl). Nothing takes them the other way: the sweep copies the
// running set under Proxy.runMu and visits each pump after releasing it, the poller calls
// ready with none of its locks held, and the idle poller is looked up (Proxy.idleMu)
// before parkCopy.mu.
