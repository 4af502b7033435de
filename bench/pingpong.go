package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// pingpong: closed-loop round trips, one request in flight per connection: write Payload
// bytes, read them back, check, repeat. Latency is the round trip; the rate is whatever the
// path allows.

func runPingPong(ctx context.Context, r *run) error {
	conns, err := dialAll(ctx, r.target, r.opts.Conns)
	if err != nil {
		return err
	}
	o := r.opts
	start := time.Now()
	deadline := start.Add(o.Duration)
	count := int64(o.Count)
	hists := make([]Histogram, len(conns))
	errs := make([]error, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			defer c.Close()
			n := count / int64(len(conns))
			if i < int(count%int64(len(conns))) {
				n++
			}
			errs[i] = pingPongConn(ctx, c, deadline, n, o.Payload, &hists[i])
		})
	}
	wg.Wait()
	r.res.Elapsed = time.Since(start)
	r.res.Latency = mergeAll(hists)
	r.res.Ops = int64(r.res.Latency.Count())
	r.res.Bytes = r.res.Ops * int64(o.Payload)
	return errors.Join(errs...)
}

// pingPongConn does round trips until deadline, or n of them when n > 0.
func pingPongConn(ctx context.Context, c net.Conn, deadline time.Time, n int64, size int, h *Histogram) error {
	defer closeOnCancel(ctx, c)()
	req := make([]byte, size)
	resp := make([]byte, size)
	for seq := uint64(0); ; seq++ {
		if n > 0 && int64(seq) >= n || n == 0 && !time.Now().Before(deadline) {
			return nil
		}
		fillRequest(req, seq)
		t0 := time.Now()
		if _, err := c.Write(req); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		if _, err := io.ReadFull(c, resp); err != nil {
			return fmt.Errorf("read response %d: %w", seq, err)
		}
		h.Record(time.Since(t0))
		if err := checkResponse(resp, seq); err != nil {
			return err
		}
	}
}

// roundTrip does one checked request/response on c.
func roundTrip(c net.Conn, size int, seq uint64) error {
	buf := make([]byte, size)
	fillRequest(buf, seq)
	if _, err := c.Write(buf); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if _, err := io.ReadFull(c, buf); err != nil {
		return fmt.Errorf("read response: %w", err)
	}
	return checkResponse(buf, seq)
}
