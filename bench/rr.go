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

// rr: Payload-sized requests at a fixed total Rate spread over Conns connections, open loop.
// Each request has a scheduled send time; its latency runs from that time to the moment its
// response has been read and checked. A sender that falls behind (the proxy stalls, the write
// blocks) sends late but does not move the schedule, so the stall shows in the latencies
// instead of being omitted. The one exception is the timer's own lateness (see rrConn).

// maxInFlight bounds requests sent but not yet answered on one connection.
const maxInFlight = 1 << 14

func runRR(ctx context.Context, r *run) error {
	conns, err := dialAll(ctx, r.target, r.opts.Conns)
	if err != nil {
		return err
	}
	o := r.opts
	interval := time.Duration(float64(time.Second) * float64(o.Conns) / o.Rate)
	start := time.Now().Add(10 * time.Millisecond) // let every sender reach its first sleep
	end := start.Add(o.Duration)
	r.res.Rate = o.Rate

	hists := make([]Histogram, len(conns))
	answered := make([]int64, len(conns))
	sentN := make([]int64, len(conns))
	errs := make([]error, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		// Connections are staggered so the total load is even, not bursts of Conns.
		first := start.Add(interval * time.Duration(i) / time.Duration(len(conns)))
		wg.Go(func() {
			defer c.Close()
			sentN[i], answered[i], errs[i] = rrConn(ctx, c, first, end, interval, o.Payload, &hists[i])
		})
	}
	wg.Wait()

	r.res.Latency = mergeAll(hists)
	var sent int64
	for i := range hists {
		r.res.Ops += answered[i]
		sent += sentN[i]
	}
	r.res.Missed = sent - r.res.Ops
	r.res.Elapsed = end.Sub(start)
	r.res.Bytes = r.res.Ops * int64(o.Payload)
	return errors.Join(errs...)
}

// rrConn runs one connection's share: a sender on the schedule and a reader that matches
// responses, in order, to their scheduled times.
func rrConn(ctx context.Context, c net.Conn, first, end time.Time, interval time.Duration, size int, h *Histogram) (sent, answered int64, err error) {
	defer closeOnCancel(ctx, c)()
	due := make(chan time.Time, maxInFlight)
	var werr error
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(due)
		req := make([]byte, size)
		timer := time.NewTimer(0)
		defer timer.Stop()
		for at := first; at.Before(end); at = at.Add(interval) {
			base := at
			if d := time.Until(at); d > 0 {
				timer.Reset(d)
				select {
				case <-timer.C:
				case <-ctx.Done():
					return
				}
				// Go's timers fire up to a millisecond late (epoll waits in whole
				// milliseconds). That lateness is the generator's, not the path's: when
				// the sender was idle, waiting for this request's time, latency counts from
				// the wake-up. When it was behind schedule, it counts from the schedule.
				base = time.Now()
			}
			fillRequest(req, uint64(sent))
			due <- base // before the write: the response may come back at once
			if _, err := c.Write(req); err != nil {
				werr = fmt.Errorf("write: %w", err)
				c.Close() // the reader waits for a response that will not come
				return
			}
			sent++
		}
		c.SetReadDeadline(time.Now().Add(drainGrace))
	})
	resp := make([]byte, size)
	var rerr error
	for at := range due {
		if rerr != nil {
			continue // drain the schedule so the sender never blocks
		}
		if _, err := io.ReadFull(c, resp); err != nil {
			rerr = fmt.Errorf("read response %d: %w", answered, err)
			c.Close()
			continue
		}
		h.Record(time.Since(at))
		if err := checkResponse(resp, uint64(answered)); err != nil {
			rerr = err
			c.Close()
			continue
		}
		answered++
	}
	wg.Wait()
	if werr != nil && rerr != nil {
		return sent, answered, rerr // the write failed because the read side closed
	}
	return sent, answered, errors.Join(werr, rerr)
}
