package bench

import (
	"fmt"
	"html"
	"io"
	"math"
	"strings"
	"time"
)

// WriteSVG draws the latency distributions of the latency cases (pingpong, rr, connrate):
// one panel per case, one line per path, latency on a log scale against the percentile on a
// "nines" scale (50, 90, 99, 99.9, 99.99), so the tail gets as much room as the median. The
// repetitions of each run are merged.
func (rep *Report) WriteSVG(w io.Writer) error {
	type series struct {
		path string
		h    *Histogram
	}
	var panels [][]series
	var titles []string
	for _, c := range []string{"pingpong", "rr", "connrate"} {
		var ss []series
		for _, p := range rep.Paths {
			h := new(Histogram)
			for _, r := range rep.Runs {
				if r.Case == c && r.Path == p && r.Latency != nil {
					h.Merge(r.Latency)
				}
			}
			if h.Count() > 0 {
				ss = append(ss, series{p, h})
			}
		}
		if len(ss) > 0 {
			panels = append(panels, ss)
			titles = append(titles, caseTitle(c))
		}
	}

	const (
		width, panelH    = 940, 380
		left, right, top = 80, 250, 40
		bottom           = 50
		maxNines         = 4.0 // p99.99
		plotW            = width - left - right
		plotH            = panelH - top - bottom
		palette          = "#1f77b4 #d62728 #2ca02c #ff7f0e #9467bd #8c564b #e377c2 #7f7f7f #17becf"
	)
	colors := strings.Fields(palette)
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n",
		width, panelH*max(1, len(panels)))
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	if len(panels) == 0 {
		fmt.Fprintf(&b, `<text x="20" y="40">no latency measurements</text>`+"\n")
	}
	for i, ss := range panels {
		y0 := i * panelH
		// Latency range over every line, widened to whole decades.
		lo, hi := math.Inf(1), 0.0
		for _, s := range ss {
			lo = math.Min(lo, float64(max(s.h.Percentile(0), time.Microsecond)))
			hi = math.Max(hi, float64(max(s.h.Max(), time.Microsecond)))
		}
		logLo, logHi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
		if logHi <= logLo {
			logHi = logLo + 1
		}
		xOf := func(nines float64) float64 { return left + nines/maxNines*plotW }
		yOf := func(d float64) float64 {
			return float64(y0+top) + (logHi-math.Log10(math.Max(d, 1)))/(logHi-logLo)*plotH
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="14" font-weight="bold">%s</text>`+"\n", left, y0+24, html.EscapeString(titles[i]))
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#888"/>`+"\n", left, y0+top, plotW, plotH)
		for e := logLo; e <= logHi; e++ {
			y := yOf(math.Pow(10, e))
			fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, left+plotW, y, y)
			fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", left-6, y+4, fmtDur(time.Duration(math.Pow(10, e))))
		}
		for _, t := range []struct {
			nines float64
			label string
		}{{0, "p0"}, {math.Log10(2), "p50"}, {1, "p90"}, {2, "p99"}, {3, "p99.9"}, {4, "p99.99"}} {
			x := xOf(t.nines)
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#ddd"/>`+"\n", x, x, y0+top, y0+top+plotH)
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", x, y0+top+plotH+18, t.label)
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle" fill="#555">percentile</text>`+"\n", left+plotW/2, y0+top+plotH+38)
		for j, s := range ss {
			color := colors[j%len(colors)]
			// Beyond 1/count the percentile is just the maximum: stop the line there.
			end := math.Min(maxNines, math.Log10(float64(s.h.Count())))
			var pts []string
			for n := 0.0; n <= end+1e-9; n += 0.02 {
				p := 100 * (1 - math.Pow(10, -n))
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", xOf(n), yOf(float64(s.h.Percentile(p)))))
			}
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", color, strings.Join(pts, " "))
			ly := y0 + top + 10 + 20*j
			fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="3"/>`+"\n", left+plotW+12, left+plotW+32, ly, ly, color)
			fmt.Fprintf(&b, `<text x="%d" y="%d">%s (p50 %s)</text>`+"\n", left+plotW+38, ly+4,
				html.EscapeString(s.path), fmtDur(s.h.Percentile(50)))
		}
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func caseTitle(c string) string {
	switch c {
	case "pingpong":
		return "pingpong: closed-loop 1 KiB round trips, one connection"
	case "rr":
		return "rr: 1 KiB requests at 1000/s on 4 connections, from the scheduled send time"
	case "connrate":
		return "connrate: new connection to first 1 KiB response"
	}
	return c
}
