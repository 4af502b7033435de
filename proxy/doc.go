// Package proxy is the data plane of a node: the listeners (outbound capture 15001, inbound
// plaintext 15006, inbound HBONE 15008, SOCKS5 15080) and, for each connection, the flow of
// resolve → authorize → dial → copy → record.
//
// It owns connection handling and drain. It does not own the wire protocol (hbone), the
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
//   - Copying: handOff starts the copy on a fresh tracked goroutine (copy.go says why),
//     which copies the client's socket into the HBONE stream or the plain leg. The other
//     direction of a socket ↔ HBONE stream pair runs on the HBONE connection's frame
//     reader (hbone.Stream.DeliverTo), which writes each DATA frame straight to the
//     socket, so an idle proxied connection holds one goroutine, not two; plain TCP ↔ TCP
//     pairs copy each way on a goroutine of its own and splice.
//   - Draining and policy: the tracker (track.go) waits for every goroutine it started and
//     closes what is left at the drain deadline; Serve's own goroutine runs the policy
//     watcher (watchPolicies), which closes live inbound connections that a policy change
//     now denies.
//
// Locks, each guarding only its own struct's fields: tracker.mu (draining, live),
// liveConn.mu (its closers), Proxy.acceptMu (acceptFailing), summaryLog.mu (the summary
// lines of drops, handshake failures and key limits). None is held while another is
// taken, nor across I/O.
