// Package token reads the bearer token file (AUTH_TOKEN) that the xDS and CA clients send
// as "authorization: Bearer <token>". It does not know what the token is for.
package token

import (
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"strings"
	"sync"
)

// File is a token file, read again on every call since projected tokens rotate. A file
// that does not exist means no token, as AUTH_TOKEN's help says: a control plane on its
// plaintext port (istiod's 15010) asks for none. Each time the file goes missing, one WARN
// names the path. A file that exists but cannot be read is an error.
type File struct {
	path string
	log  *slog.Logger

	mu      sync.Mutex
	missing bool // guarded by mu: the last read found no file (and warned)
}

// NewFile returns the token file at path; "" means no token. log gets the WARN.
func NewFile(path string, log *slog.Logger) *File {
	return &File{path: path, log: log}
}

// Authorization returns the authorization metadata value, "" when there is no token.
func (f *File) Authorization() (string, error) {
	if f.path == "" {
		return "", nil
	}
	data, err := os.ReadFile(f.path)
	missing := errors.Is(err, fs.ErrNotExist)
	f.mu.Lock()
	warn := missing && !f.missing
	f.missing = missing
	f.mu.Unlock()
	if warn {
		f.log.Warn("no token file: calling without authorization", "path", f.path)
	}
	if err != nil && !missing {
		return "", err
	}
	if t := strings.TrimSpace(string(data)); t != "" {
		return "Bearer " + t, nil
	}
	return "", nil
}
