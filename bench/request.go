package bench

import (
	"encoding/binary"
	"fmt"
)

// A request is Payload bytes: an 8-byte sequence number then the pattern stream at an offset
// derived from it, so a response that belongs to another request, or is damaged, fails the
// check. The echo server returns it unchanged.

// fillRequest writes request seq into b.
func fillRequest(b []byte, seq uint64) {
	if len(b) < 8 {
		copy(b, patternAt(int64(seq), len(b)))
		return
	}
	binary.BigEndian.PutUint64(b, seq)
	copy(b[8:], patternAt(int64(seq%patternPeriod), len(b)-8))
}

// checkResponse reports whether b is the echo of request seq.
func checkResponse(b []byte, seq uint64) error {
	if len(b) < 8 {
		return checkPattern(int64(seq), b)
	}
	if got := binary.BigEndian.Uint64(b); got != seq {
		return fmt.Errorf("%w: response %d where %d was due", ErrCorrupt, got, seq)
	}
	return checkPattern(int64(seq%patternPeriod), b[8:])
}
