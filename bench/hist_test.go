package bench

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestHistogramPercentilesOfKnownInputs(t *testing.T) {
	var h Histogram
	// 1..10000 µs in shuffled order: the p-th percentile is p*100 µs.
	vals := rand.New(rand.NewPCG(1, 2)).Perm(10000)
	for _, v := range vals {
		h.Record(time.Duration(v+1) * time.Microsecond)
	}
	for _, tc := range []struct {
		p    float64
		want time.Duration
	}{
		{50, 5000 * time.Microsecond},
		{90, 9000 * time.Microsecond},
		{99, 9900 * time.Microsecond},
		{99.9, 9990 * time.Microsecond},
		{100, 10000 * time.Microsecond},
		{0, 1 * time.Microsecond},
	} {
		got := h.Percentile(tc.p)
		if rel := float64(got-tc.want) / float64(tc.want); rel > 1.0/128 || rel < -1.0/128 {
			t.Errorf("p%v = %v; want %v within 1/128", tc.p, got, tc.want)
		}
	}
	if h.Max() != 10*time.Millisecond {
		t.Errorf("max = %v; want exactly 10ms", h.Max())
	}
	if h.Count() != 10000 {
		t.Errorf("count = %d; want 10000", h.Count())
	}
	if want := 5000500 * time.Nanosecond; h.Mean() != want {
		t.Errorf("mean = %v; want %v", h.Mean(), want)
	}
}

func TestHistogramSmallValuesAreExact(t *testing.T) {
	var h Histogram
	for v := range 256 {
		h.Record(time.Duration(v))
	}
	for _, p := range []float64{10, 50, 75, 99} {
		rank := int(p / 100 * 256) // ceil(p*256/100) - 1, all exact here
		if p*256/100 != float64(rank) {
			rank++
		}
		if got, want := h.Percentile(p), time.Duration(rank-1); got != want {
			t.Errorf("p%v = %v; want %v", p, got, want)
		}
	}
}

func TestHistogramBucketsCoverEveryValue(t *testing.T) {
	for _, v := range []uint64{0, 255, 256, 257, 1 << 20, 1<<20 + 12345, 1<<62 + 1, 1<<63 - 1} {
		i := bucketOf(v)
		if i < 0 || i >= histBuckets {
			t.Fatalf("bucketOf(%d) = %d; out of range", v, i)
		}
		mid := bucketMid(i)
		if diff := float64(mid) - float64(v); diff > float64(v)/128+1 || -diff > float64(v)/128+1 {
			t.Errorf("bucketMid(bucketOf(%d)) = %d; more than 1/128 off", v, mid)
		}
	}
}

func TestHistogramMerge(t *testing.T) {
	var a, b Histogram
	for i := range 100 {
		a.Record(time.Duration(i) * time.Millisecond)
		b.Record(time.Duration(i+100) * time.Millisecond)
	}
	a.Merge(&b)
	if a.Count() != 200 || a.Max() != 199*time.Millisecond {
		t.Fatalf("merged count %d max %v; want 200, 199ms", a.Count(), a.Max())
	}
	if got := a.Percentile(50); got < 98*time.Millisecond || got > 101*time.Millisecond {
		t.Errorf("merged p50 = %v; want ~99ms", got)
	}
	if got := a.Percentile(0); got != 0 {
		t.Errorf("merged min = %v; want 0", got)
	}
}
