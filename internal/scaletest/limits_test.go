package scaletest

// Bounds of TestScale10k, bytes per workload above a 15-workload node: twice what the node
// measured when they were set, so a change that doubles memory per workload fails.
const (
	maxSettledPerWorkload = 2 * 4000
	maxPeakPerWorkload    = 2 * 4000
)

// rustEnv is what the Rust ztunnel needs beside the listener addresses to run against the
// plaintext ADS server.
func rustEnv() []string { return []string{"FAKE_CA=true"} }
