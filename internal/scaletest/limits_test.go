package scaletest

// Bounds of TestScale10k, bytes per workload above a 15-workload node. When set the node
// measured a live heap of 606-610 B and an RSS of 1,005-1,125 B (settled or peak, by when
// the GC ran); aca0cb6 measured 4,000 B of RSS, 85e0f33 a heap of 1,005 B. The heap bound
// is 1.6 times the figure, the RSS one 1.9 times the typical (RSS moves with the
// collector's timing): a change doubling memory per workload fails either.
const (
	maxHeapPerWorkload = 610 * 16 / 10
	maxRSSPerWorkload  = 2000
)

// rssKeptAnyway is RSS a node keeps after a push and the push deleting it whatever their
// size (code pages they ran, the runtime's own structures): after 10k workloads the node
// kept 4-6 MB over its RSS before them, when the workloads' own share was 10-13 MB.
// TestScale10k allows it on top of half that share.
const rssKeptAnyway = 4 << 20

// rustMaxPush is the Rust ztunnel's receive limit for a DeltaDiscoveryResponse.
const rustMaxPush = 200 << 20
