package bench

import (
	"errors"
	"fmt"
)

// ErrCorrupt reports that bytes read back differ from the bytes sent.
var ErrCorrupt = errors.New("bench: corrupt data")

// patternPeriod is prime, so a loss or duplication of any power-of-two sized chunk leaves the
// stream misaligned with itself and is caught by the byte check.
const patternPeriod = 65521

// maxChunk is the largest slice patternAt returns: one write or read of bulk data.
const maxChunk = 256 << 10

// pattern holds one period of pseudo-random bytes followed by enough of its start that any
// offset can be served as one contiguous slice of up to maxChunk bytes.
var pattern = makePattern()

func makePattern() []byte {
	b := make([]byte, patternPeriod+maxChunk)
	x := uint32(2463534242)
	for i := range patternPeriod {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x >> 7)
	}
	for i := patternPeriod; i < len(b); i++ {
		b[i] = b[i-patternPeriod]
	}
	return b
}

// patternAt returns the n bytes (n <= maxChunk) of the endless pattern stream at offset off.
func patternAt(off int64, n int) []byte {
	s := int(off % patternPeriod)
	return pattern[s : s+n]
}

// checkPattern returns an error wrapping ErrCorrupt if b is not the pattern stream at off.
func checkPattern(off int64, b []byte) error {
	for len(b) > 0 {
		n := min(len(b), maxChunk)
		want := patternAt(off, n)
		if string(b[:n]) != string(want) { // compiled to a memequal, no allocation
			for i := range n {
				if b[i] != want[i] {
					return fmt.Errorf("%w at byte %d", ErrCorrupt, off+int64(i))
				}
			}
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}
