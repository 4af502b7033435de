package bench

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// progress keeps one status line up to date on a terminal: which run, how many are done,
// how long this one has taken. A nil writer makes every method a no-op.
type progress struct {
	w     io.Writer
	total int
	stopc chan struct{}
	done  chan struct{}
	once  sync.Once

	mu    sync.Mutex
	n     int
	label string
	since time.Time
}

func startProgress(w io.Writer, total int) *progress {
	p := &progress{w: w, total: total, stopc: make(chan struct{}), done: make(chan struct{})}
	if w == nil {
		close(p.done)
		return p
	}
	go p.loop()
	return p
}

// begin marks the start of the next run.
func (p *progress) begin(label string) {
	p.mu.Lock()
	p.n++
	p.label, p.since = label, time.Now()
	p.mu.Unlock()
}

func (p *progress) loop() {
	defer close(p.done)
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.stopc:
			fmt.Fprint(p.w, "\r\x1b[K")
			return
		case <-t.C:
			p.mu.Lock()
			if p.label != "" {
				fmt.Fprintf(p.w, "\r\x1b[K[%d/%d] %s  %.1fs", p.n, p.total, p.label, time.Since(p.since).Seconds())
			}
			p.mu.Unlock()
		}
	}
}

// stop clears the line and waits for the updater; it is safe to call more than once.
func (p *progress) stop() {
	p.once.Do(func() { close(p.stopc) })
	<-p.done
}
