// Package hbone is the HBONE wire: HTTP/2 CONNECT tunnels over mutual TLS, as spoken by
// Istio's ztunnel, waypoints and east-west gateways, usable in any Go program that dials
// or serves HBONE. It knows nothing of xDS, workloads or where certificates come from (the
// caller hands it a *tls.Config) and decides no policy (a Handler answers 200, 401 or
// 503); of this module it imports only the SPIFFE ID type (package identity) and two
// internal helpers (kernel TLS, goroutine reuse).
//
// A Pool dials client connections and pools them per Key (source identity, expected peer
// identities, address, source IP); a Server hands each CONNECT stream to a Handler with
// the peer's verified identity; a Stream behaves like a TCP connection (half-close with
// END_STREAM, abort with RST_STREAM, deadlines). Connections keep alive with PING and
// drain with GOAWAY. The package example opens a stream through a Pool to a Server.
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
// Defaults follow the Rust ztunnel (config.go): 4 MiB stream and 16 MiB connection
// windows, 1 MiB frames, 100 streams per pooled connection, 200 advertised by a server,
// PING every 10 s with a 20 s timeout.
//
// # Where to read on
//
// The API: client.go (Pool), server.go (Server, Handler, Request), stream.go (Stream),
// deliver.go and readfrom.go (a Stream's two copy paths), config.go (the configuration
// and its defaults), errors.go. conn.go is one connection: why it is our own loop on
// x/net/http2's Framer, its goroutines and its lock order; read.go is its frame reader,
// write.go and buf.go its writers, flow.go its windows, trim.go its idle buffers. What a
// hostile peer may make a connection do: limits.go; a whole Server: admission.go,
// admit.go and hold.go (what a connection refused as it is accepted gets). keylimit.go
// drains a connection before its TLS keys' record limit. Kernel TLS: ktls.go, ksend.go
// and kread.go.
package hbone
