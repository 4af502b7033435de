package bench

import (
	"context"
	"fmt"
	"net"
	"time"
)

// idle: open Conns connections, prove each works with one round trip, hold them for
// Duration and charge the proxies' resident-set growth to them. The figure that matters is
// bytes per held connection; a direct path has no proxy and so no figure.

func runIdle(ctx context.Context, r *run) error {
	o := r.opts
	before := r.meter.sample()
	start := time.Now()
	conns := make([]net.Conn, 0, o.Conns)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range o.Conns {
		c, err := r.target.Dial(ctx)
		if err != nil {
			return fmt.Errorf("connection %d: %w", i, err)
		}
		conns = append(conns, c)
		if err := roundTrip(c, o.Payload, uint64(i)); err != nil {
			return fmt.Errorf("connection %d: %w", i, err)
		}
		r.res.Ops++
	}
	select {
	case <-time.After(o.Duration):
	case <-ctx.Done():
		return ctx.Err()
	}
	held := r.meter.sample()
	// The connections must still work after the hold: a proxy that dropped them saved
	// memory it should not get credit for.
	for i, c := range conns {
		if err := roundTrip(c, o.Payload, uint64(i)); err != nil {
			return fmt.Errorf("connection %d after the hold: %w", i, err)
		}
	}
	r.res.Elapsed = time.Since(start)
	r.res.IdleConns = len(conns)
	r.res.IdleRSSDelta = held - before
	r.res.Bytes = 2 * r.res.Ops * int64(o.Payload)
	return nil
}
