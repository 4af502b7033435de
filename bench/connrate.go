package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// connrate: Conns workers each open a new connection per request: dial (and the SOCKS5
// exchange), one checked Payload round trip, close. The latency is connection setup up to
// the first response, so a proxy that answers the dial before its upstream is ready cannot
// look faster than it is.

func runConnRate(ctx context.Context, r *run) error {
	o := r.opts
	start := time.Now()
	deadline := start.Add(o.Duration)
	var remaining atomic.Int64
	remaining.Store(int64(o.Count))
	hists := make([]Histogram, o.Conns)
	errs := make([]error, o.Conns)
	var wg sync.WaitGroup
	for i := range o.Conns {
		wg.Go(func() {
			for ctx.Err() == nil {
				if o.Count > 0 && remaining.Add(-1) < 0 || o.Count == 0 && !time.Now().Before(deadline) {
					return
				}
				t0 := time.Now()
				if err := oneConn(ctx, r.target, o.Payload); err != nil {
					errs[i] = err
					return
				}
				hists[i].Record(time.Since(t0))
			}
			errs[i] = ctx.Err()
		})
	}
	wg.Wait()
	r.res.Elapsed = time.Since(start)
	r.res.Latency = mergeAll(hists)
	r.res.Ops = int64(r.res.Latency.Count())
	r.res.Bytes = r.res.Ops * int64(o.Payload)
	return errors.Join(errs...)
}

func oneConn(ctx context.Context, t Target, size int) error {
	c, err := t.Dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := roundTrip(c, size, 0); err != nil {
		return fmt.Errorf("first round trip: %w", err)
	}
	return nil
}
