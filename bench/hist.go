package bench

import (
	"math"
	"math/bits"
	"time"
)

// Histogram records durations with a relative error under 1/128 (0.8%) in fixed memory, in the
// manner of HdrHistogram: values below 256 ns are exact, larger ones fall in one of 128 linear
// sub-buckets per power of two. It is not safe for concurrent use; give each goroutine its own
// and Merge them.
type Histogram struct {
	counts   [histBuckets]uint64
	n        uint64
	sum      time.Duration
	min, max time.Duration
}

const (
	subBits     = 7
	subCount    = 1 << subBits // sub-buckets per power of two
	histBuckets = 2*subCount + (64-subBits-1)*subCount
)

func bucketOf(v uint64) int {
	if v < 2*subCount {
		return int(v)
	}
	shift := bits.Len64(v) - subBits - 1
	top := v >> shift // in [subCount, 2*subCount)
	return 2*subCount + (shift-1)*subCount + int(top-subCount)
}

// bucketMid returns the middle of the value range bucket i stands for.
func bucketMid(i int) uint64 {
	if i < 2*subCount {
		return uint64(i)
	}
	shift := (i-2*subCount)/subCount + 1
	top := uint64((i-2*subCount)%subCount + subCount)
	return top<<shift + (uint64(1)<<shift)/2
}

// Record adds one value; negative durations count as zero.
func (h *Histogram) Record(d time.Duration) {
	d = max(d, 0)
	h.counts[bucketOf(uint64(d))]++
	if h.n == 0 || d < h.min {
		h.min = d
	}
	if d > h.max {
		h.max = d
	}
	h.n++
	h.sum += d
}

// mergeAll returns one histogram holding every value of hs (one per connection).
func mergeAll(hs []Histogram) *Histogram {
	h := new(Histogram)
	for i := range hs {
		h.Merge(&hs[i])
	}
	return h
}

// Merge adds every value recorded in o.
func (h *Histogram) Merge(o *Histogram) {
	if o == nil || o.n == 0 {
		return
	}
	for i, c := range o.counts {
		h.counts[i] += c
	}
	if h.n == 0 || o.min < h.min {
		h.min = o.min
	}
	h.max = max(h.max, o.max)
	h.n += o.n
	h.sum += o.sum
}

// Count returns how many values were recorded.
func (h *Histogram) Count() uint64 { return h.n }

// Max returns the largest value recorded, exactly.
func (h *Histogram) Max() time.Duration { return h.max }

// Mean returns the exact mean of the recorded values.
func (h *Histogram) Mean() time.Duration {
	if h.n == 0 {
		return 0
	}
	return h.sum / time.Duration(h.n)
}

// Percentile returns the value at or below which p percent (0-100) of the recorded values lie,
// to within the histogram's precision; 0 when nothing was recorded.
func (h *Histogram) Percentile(p float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(p / 100 * float64(h.n)))
	rank = min(max(rank, 1), h.n)
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			v := time.Duration(bucketMid(i))
			return min(max(v, h.min), h.max)
		}
	}
	return h.max
}

// LatencySummary is the machine-readable digest of a Histogram.
type LatencySummary struct {
	Count uint64        `json:"count"`
	Mean  time.Duration `json:"mean_ns"`
	P50   time.Duration `json:"p50_ns"`
	P90   time.Duration `json:"p90_ns"`
	P99   time.Duration `json:"p99_ns"`
	P999  time.Duration `json:"p999_ns"`
	Max   time.Duration `json:"max_ns"`
}

// Summary returns the usual percentiles.
func (h *Histogram) Summary() LatencySummary {
	return LatencySummary{
		Count: h.n, Mean: h.Mean(),
		P50: h.Percentile(50), P90: h.Percentile(90), P99: h.Percentile(99), P999: h.Percentile(99.9),
		Max: h.max,
	}
}
