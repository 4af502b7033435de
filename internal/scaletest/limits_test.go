package scaletest

// Bounds of TestScale10k, bytes per workload above a 15-workload node. When set the node
// measured a live heap of 1,050 B and an RSS of 1,650-2,300 B (settled or peak, by when
// the GC ran); aca0cb6 measured 4,000 B of RSS. The heap bound is 1.6 times the figure,
// the RSS one 1.7 times the typical: a change doubling memory per workload fails either.
const (
	maxHeapPerWorkload = 1050 * 16 / 10
	maxRSSPerWorkload  = 3000
)

// rustMaxPush is the Rust ztunnel's receive limit for a DeltaDiscoveryResponse.
const rustMaxPush = 200 << 20
