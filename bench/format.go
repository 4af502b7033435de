package bench

import (
	"fmt"
	"io"
	"time"
)

// WriteResult prints one scenario's figures for a person.
func WriteResult(w io.Writer, r *Result) {
	fmt.Fprintf(w, "%s via %s: %d conns, %d B payload, %v\n", r.Scenario, r.Target, r.Conns, r.Payload, r.Elapsed.Round(time.Millisecond))
	switch r.Scenario {
	case "throughput":
		fmt.Fprintf(w, "  %.2f Gbit/s, %s checked\n", r.Gbps(), fmtBytes(r.Bytes))
	case "rr":
		fmt.Fprintf(w, "  %.0f req/s offered, %d answered, %d unanswered\n", r.Rate, r.Ops, r.Missed)
	case "pingpong":
		fmt.Fprintf(w, "  %d round trips, %.0f/s\n", r.Ops, r.OpsPerSec())
	case "connrate":
		fmt.Fprintf(w, "  %d connections, %.0f conns/s (latency: setup to first response)\n", r.Ops, r.OpsPerSec())
	case "idle":
		fmt.Fprintf(w, "  %d connections held\n", r.IdleConns)
	}
	if s := r.Summary; s != nil {
		fmt.Fprintf(w, "  latency p50 %s  p90 %s  p99 %s  p99.9 %s  max %s  (mean %s)\n",
			fmtDur(s.P50), fmtDur(s.P90), fmtDur(s.P99), fmtDur(s.P999), fmtDur(s.Max), fmtDur(s.Mean))
	}
	for _, p := range r.Procs {
		fmt.Fprintf(w, "  %-16s cpu %.2fs  peak rss %s (anon %s)  hwm %s\n", p.Name, p.CPUSeconds, fmtBytes(p.PeakRSS), fmtBytes(p.PeakAnon), fmtBytes(p.HWM))
	}
	if len(r.Procs) > 0 {
		switch r.Scenario {
		case "throughput":
			fmt.Fprintf(w, "  proxies: %.2f cpu-s/GB\n", r.CPUPerGB())
		case "rr", "pingpong":
			fmt.Fprintf(w, "  proxies: %.3f vCPU per 1000 req/s\n", r.VCPUPer1000RPS())
		case "connrate":
			fmt.Fprintf(w, "  proxies: %s cpu per connection\n", fmtDur(r.CPUPerOp()))
		case "idle":
			fmt.Fprintf(w, "  proxies: %s per idle connection\n", fmtBytes(int64(r.BytesPerIdleConn())))
		}
	}
}

// fmtDur prints a latency with three significant digits in a unit that suits it.
func fmtDur(d time.Duration) string {
	switch {
	case d < time.Microsecond:
		return fmt.Sprintf("%dns", d)
	case d < time.Millisecond:
		return fmt.Sprintf("%.3gµs", float64(d)/1e3)
	case d < time.Second:
		return fmt.Sprintf("%.3gms", float64(d)/1e6)
	}
	return fmt.Sprintf("%.3gs", d.Seconds())
}

func fmtBytes(n int64) string {
	switch {
	case n < 0:
		return "-" + fmtBytes(-n)
	case n < 1<<10:
		return fmt.Sprintf("%dB", n)
	case n < 1<<20:
		return fmt.Sprintf("%.1fKiB", float64(n)/(1<<10))
	case n < 1<<30:
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.2fGiB", float64(n)/(1<<30))
}
