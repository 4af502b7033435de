package inpod

import "fmt"

// maxMessage is the read buffer: one request, as the Rust ztunnel reads it.
const maxMessage = 1024

// badMessage is a packet that could not be read as a request: NACKed, then the connection
// is dropped.
type badMessage struct{ reason string }

func (e *badMessage) Error() string { return e.reason }

func bad(format string, args ...any) error { return &badMessage{fmt.Sprintf(format, args...)} }
