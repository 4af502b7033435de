package inpod

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// connectFailures records when each failed connect was logged.
type connectFailures struct {
	slog.Handler
	mu sync.Mutex
	at []time.Time
}

func (h *connectFailures) Enabled(context.Context, slog.Level) bool { return true }

func (h *connectFailures) Handle(_ context.Context, r slog.Record) error {
	if r.Message == msgConnectFailed {
		h.mu.Lock()
		h.at = append(h.at, r.Time)
		h.mu.Unlock()
	}
	return nil
}

func (h *connectFailures) WithAttrs([]slog.Attr) slog.Handler { return h }

// With no agent listening, ztunnel redials after 10 ms, doubling up to 15 s.
func TestReconnectBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := &connectFailures{}
		m := New(Config{Path: t.TempDir() + "/missing.sock", Logger: slog.New(h)}, nil)
		time.Sleep(40 * time.Second)
		m.Close()
		want := []time.Duration{10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120, 10240, 15000}
		h.mu.Lock()
		defer h.mu.Unlock()
		if len(h.at) != len(want)+1 {
			t.Fatalf("%d connect attempts in 40 s; want %d", len(h.at), len(want)+1)
		}
		for i, w := range want {
			if got := h.at[i+1].Sub(h.at[i]); got != w*time.Millisecond {
				t.Errorf("wait %d = %v; want %v", i, got, w*time.Millisecond)
			}
		}
	})
}
