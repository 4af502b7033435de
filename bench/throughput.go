package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// throughput: bulk transfer on Conns parallel connections for Duration. Every byte is
// checked: in echo mode the client reads its own stream back, in "down" mode it checks the
// source's stream, in "up" mode the sink checks it and acknowledges the count.

// drainGrace bounds how long the end of a run waits for bytes still in flight.
const drainGrace = 10 * time.Second

func runThroughput(ctx context.Context, r *run) error {
	var stream func(context.Context, net.Conn, time.Time, int) (int64, error)
	switch r.opts.Direction {
	case "echo":
		stream = echoStream
	case "up":
		stream = upStream
	case "down":
		stream = downStream
	default:
		return fmt.Errorf("unknown direction %q (want echo, up or down)", r.opts.Direction)
	}
	conns, err := dialAll(ctx, r.target, r.opts.Conns)
	if err != nil {
		return err
	}
	start := time.Now()
	deadline := start.Add(r.opts.Duration)
	var total atomic.Int64
	errs := make([]error, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			defer c.Close()
			n, err := stream(ctx, c, deadline, r.opts.Payload)
			total.Add(n)
			errs[i] = err
		})
	}
	wg.Wait()
	r.res.Elapsed = time.Since(start)
	r.res.Bytes = total.Load()
	r.res.Ops = int64(len(conns))
	return errors.Join(errs...)
}

// dialAll opens n connections, closing them all if any fails.
func dialAll(ctx context.Context, t Target, n int) ([]net.Conn, error) {
	conns := make([]net.Conn, 0, n)
	for range n {
		c, err := t.Dial(ctx)
		if err != nil {
			for _, c := range conns {
				c.Close()
			}
			return nil, err
		}
		conns = append(conns, c)
	}
	return conns, nil
}

// closeOnCancel closes c when ctx ends; the returned func stops that.
func closeOnCancel(ctx context.Context, c net.Conn) func() bool {
	return context.AfterFunc(ctx, func() { c.Close() })
}

// echoStream writes the pattern until deadline and checks the echo until it has every byte
// back. It does not half-close: not every path passes half-close on (nginx's stream proxy
// closes both ways by default), and bulk throughput should not depend on it.
// It returns the bytes read back and checked.
func echoStream(ctx context.Context, c net.Conn, deadline time.Time, chunk int) (int64, error) {
	defer closeOnCancel(ctx, c)()
	sent := make(chan int64, 1)
	// got is written only by the reader below; the writer reads it once, after publishing
	// sent, so either the reader finds sent on the channel or the writer finds got complete.
	var got atomic.Int64
	var werr error
	var wg sync.WaitGroup
	wg.Go(func() {
		var off int64
		// At least one chunk, even when this goroutine first runs after the deadline (a
		// short run on a loaded machine), so every run measures something.
		for off == 0 || time.Now().Before(deadline) {
			n, err := c.Write(patternAt(off, chunk))
			off += int64(n)
			if err != nil {
				werr = fmt.Errorf("write: %w", err)
				break
			}
		}
		sent <- off
		if got.Load() >= off {
			// The reader has everything and may be blocked reading more: wake it.
			c.SetReadDeadline(time.Now())
		} else {
			// Give the echo of the last bytes a bounded time to come back.
			c.SetReadDeadline(time.Now().Add(drainGrace))
		}
	})
	want := int64(-1)
	buf := make([]byte, maxChunk)
	var rerr error
	for want < 0 || got.Load() < want {
		n, err := c.Read(buf)
		if cerr := checkPattern(got.Load(), buf[:n]); cerr != nil {
			rerr = cerr
			break
		}
		got.Add(int64(n))
		if want < 0 {
			select {
			case want = <-sent:
			default:
			}
		}
		if err != nil {
			if want < 0 {
				c.Close() // the read side is gone: stop the writer too
				want = <-sent
			}
			if got.Load() < want {
				rerr = fmt.Errorf("echo returned %d of %d bytes: %w", got.Load(), want, err)
			}
			break
		}
	}
	if rerr != nil {
		c.Close() // unblock the writer
	}
	wg.Wait()
	if want < 0 {
		want = <-sent
	}
	if rerr == nil && got.Load() > want {
		rerr = fmt.Errorf("%w: echo returned %d bytes, %d sent", ErrCorrupt, got.Load(), want)
	}
	return got.Load(), errors.Join(rerr, werr)
}

// upStream writes the pattern to a sink until deadline, half-closes, and reads the sink's
// count and verdict. It returns the bytes the sink acknowledged intact.
func upStream(ctx context.Context, c net.Conn, deadline time.Time, chunk int) (int64, error) {
	defer closeOnCancel(ctx, c)()
	var off int64
	for off == 0 || time.Now().Before(deadline) { // at least one chunk, as echoStream
		n, err := c.Write(patternAt(off, chunk))
		off += int64(n)
		if err != nil {
			return 0, fmt.Errorf("write: %w", err)
		}
	}
	if err := closeWrite(c); err != nil {
		return 0, fmt.Errorf("half-close: %w", err)
	}
	c.SetReadDeadline(time.Now().Add(drainGrace))
	var reply [9]byte
	if _, err := io.ReadFull(c, reply[:]); err != nil {
		return 0, fmt.Errorf("sink reply (is the server in sink mode, does the path pass half-close?): %w", err)
	}
	got := int64(binary.BigEndian.Uint64(reply[:8]))
	if reply[8] != 0 || got != off {
		return 0, fmt.Errorf("%w: sink got %d of %d bytes, status %d", ErrCorrupt, got, off, reply[8])
	}
	return got, nil
}

// downStream asks for the source stream (an echo server turns into a source) and reads and
// checks it until deadline.
func downStream(ctx context.Context, c net.Conn, deadline time.Time, _ int) (int64, error) {
	defer closeOnCancel(ctx, c)()
	if _, err := io.WriteString(c, SourceRequest); err != nil {
		return 0, fmt.Errorf("source request: %w", err)
	}
	c.SetReadDeadline(deadline)
	buf := make([]byte, maxChunk)
	var got int64
	late := false
	for {
		n, err := c.Read(buf)
		if cerr := checkPattern(got, buf[:n]); cerr != nil {
			return got, cerr
		}
		got += int64(n)
		if errors.Is(err, os.ErrDeadlineExceeded) && got == 0 && !late {
			// Nothing yet at the deadline (a short run on a loaded machine): wait up to
			// drainGrace for the first bytes, so every run measures something.
			late = true
			c.SetReadDeadline(time.Now().Add(drainGrace))
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return got, nil
		}
		if err != nil {
			return got, fmt.Errorf("read after %d bytes: %w", got, err)
		}
	}
}
