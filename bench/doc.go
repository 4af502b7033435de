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
// From the command line (cmd/zbench):
//
//	zbench serve --listen 127.0.0.1:8080                       # echo server
//	zbench rr --socks5 127.0.0.1:15080 --target 127.0.0.1:8080 --rate 1000 --pid 4242
//	zbench suite --short                                       # what make bench runs
//	zbench suite --peers --json out.json --svg latency.svg     # ztunnel beside the peers
//	zbench suite --ztunnel-rs /path/to/ztunnel                 # as root: beside the Rust ztunnel
//
// One file per scenario (throughput.go, rr.go, pingpong.go, connrate.go, idle.go); runner.go
// holds Run, Options and Result; suite.go, topology.go and report.go the suite; capture.go
// the in-pod path between network namespaces, nspair.go the namespace pairs that run the
// Rust ztunnel (given by path, never built here) beside gozt, program.go how either is
// configured, meshca.go their one CA.
//
// It does not configure or modify the proxies it measures beyond starting them, and nothing
// else in the module imports it.
package bench
