package bench

import (
	"testing"
	"time"
)

// The generator's per-operation work must not allocate: a collector running in the client
// would add pauses to the latencies it measures.
func TestHotPathAllocs(t *testing.T) {
	var h Histogram
	buf := make([]byte, 1024)
	big := append([]byte(nil), patternAt(12345, maxChunk)...)
	for _, tc := range []struct {
		name string
		f    func()
	}{
		{"Histogram.Record", func() { h.Record(123 * time.Microsecond) }},
		{"fillRequest", func() { fillRequest(buf, 77) }},
		{"checkResponse", func() {
			if checkResponse(buf, 77) != nil {
				t.Fatal("request does not check")
			}
		}},
		{"checkPattern", func() {
			if checkPattern(12345, big) != nil {
				t.Fatal("pattern does not check")
			}
		}},
	} {
		if n := testing.AllocsPerRun(100, tc.f); n != 0 {
			t.Errorf("%s: %v allocations per call; want 0", tc.name, n)
		}
	}
}

// BenchmarkCheckPattern shows what checking every byte costs the client: it must be far
// faster than any path it measures.
func BenchmarkCheckPattern(b *testing.B) {
	buf := append([]byte(nil), patternAt(0, maxChunk)...)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		if err := checkPattern(0, buf); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkHistogramRecord(b *testing.B) {
	var h Histogram
	d := time.Duration(0)
	for b.Loop() {
		d += 997
		h.Record(d)
	}
}
