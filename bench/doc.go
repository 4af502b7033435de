// Package bench is gozt's bundled load generator: an echo/sink/source server, a client that
// drives any TCP path (direct, or through a SOCKS5 proxy such as ztunnel's 15080 listener),
// the scenarios that measure that path (throughput, rr, pingpong, connrate, idle), readers of
// /proc that charge CPU and memory to the proxy processes under test, and a suite that starts
// a two-node ztunnel topology and peer tunnels and prints one comparison table.
//
// Every byte a scenario sends is checked when it comes back, so a proxy that corrupts, drops
// or reorders data fails the run instead of looking fast. Latency in rr is measured from the
// time a request was scheduled, not when it was sent, so a stalled proxy cannot hide its
// stalls (no coordinated omission).
//
// It does not configure or modify the proxies it measures beyond starting them, and nothing
// else in the module imports it.
package bench
