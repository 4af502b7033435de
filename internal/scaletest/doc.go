// Package scaletest measures one real ztunnel process fed a generated mesh by a real delta
// ADS server: time from connect to ready, CPU seconds, peak and settled RSS, incremental
// push latency, full pushes, a reconnect with resource versions, and probe connections and
// DNS lookups through the node meanwhile. The server is ours (in the test's process), ours
// shaped as istiod sends, or go-control-plane's (tools/xdscontrol, a process and a module of
// its own). Its code is all in test files: the 10k mesh runs in make test with bounds on
// memory per workload; make bench-scale runs the 100k and 1M meshes (SCALE_SIZES) against
// each server (SCALE_SERVERS) and, with ZTUNNEL_RS set, the Rust ztunnel beside it.
//
// It does not test behaviour (xds and xds/state do); it measures the whole node.
package scaletest
