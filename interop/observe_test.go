//go:build linux

package interop

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// view is what an operator sees of one node after the same traffic: its metrics, its
// /config_dump, the access log records, and the admin endpoints' answers.
type view struct {
	metrics string
	dump    string
	access  []string // access log lines of completed connections
	admin   map[string]string
	first   string // the metrics after the first connection, the only one then
}

// TestObservability gives each program the same config and traffic (gozt→gozt, then rs→rs)
// and compares what an operator reads of them, node A with node A and node B with node B:
// every istio_*/workload_manager_* series name, type and label set, the label values of the
// same connection, the access log's fields, /config_dump's shape, and the admin endpoints'
// answers. Every difference must be listed in testdata/differences.txt.
func TestObservability(t *testing.T) {
	requirePeers(t)
	views := map[string][2]view{}
	for _, prog := range []string{gozt, rs} {
		t.Run(prog, func(t *testing.T) {
			m := newMesh(t, [2]string{prog, prog})
			// First one connection through the service VIP, alone, so that each node has
			// exactly one series for it; then a direct one and a denied one.
			if got := m.roundTrip(net.JoinHostPort(echoVIP, "80")); got != "ok" {
				t.Fatalf("%s: through the VIP: %s", prog, got)
			}
			var first [2]string
			if !eventually(func() bool {
				first = [2]string{m.nodeA.metrics(t), m.nodeB.metrics(t)}
				return len(series(first[0], "istio_tcp_connections_closed_total")) > 0 && len(series(first[1], "istio_tcp_connections_closed_total")) > 0
			}) {
				t.Fatalf("%s: the connection through the VIP was not counted closed on both nodes", prog)
			}
			for _, addr := range []string{net.JoinHostPort(serverIP, portEcho), net.JoinHostPort(serverIP, portNotAllowed)} {
				m.roundTrip(addr)
			}
			if !eventually(func() bool { return len(accessLines(m.nodeB)) >= 3 }) {
				t.Fatalf("%s: node B logged %d of 3 connections", prog, len(accessLines(m.nodeB)))
			}
			time.Sleep(500 * time.Millisecond) // the denied connection's record on node A too
			v := [2]view{observe(t, m.nodeA), observe(t, m.nodeB)}
			keep(t, prog+"-node-a", v[0])
			keep(t, prog+"-node-b", v[1])
			v[0].first, v[1].first = first[0], first[1]
			views[prog] = v
		})
	}
	if t.Failed() {
		return
	}
	diffs := compareViews(views)
	checkDifferences(t, "observability", diffs)
}

// TestAccessLogJSON compares the fields of the access log records in LOG_FORMAT=json, for the
// same connection through the service VIP (node A's record and node B's).
func TestAccessLogJSON(t *testing.T) {
	requirePeers(t)
	keys := map[string][2]map[string]bool{}
	for _, prog := range []string{gozt, rs} {
		t.Run(prog, func(t *testing.T) {
			m := newMesh(t, [2]string{prog, prog}, "LOG_FORMAT=json")
			if got := m.roundTrip(net.JoinHostPort(echoVIP, "80")); got != "ok" {
				t.Fatalf("through the VIP: %s", got)
			}
			var k [2]map[string]bool
			for i, n := range []*node{m.nodeA, m.nodeB} {
				if !eventually(func() bool { k[i] = jsonAccessKeys(t, n); return k[i] != nil }) {
					t.Fatalf("%s: no JSON access record of a completed connection:\n%s", prog, n.Tail(10))
				}
			}
			keys[prog] = k
		})
	}
	if t.Failed() {
		return
	}
	var diffs []string
	for i, role := range []string{"node A", "node B"} {
		g, r := keys[gozt][i], keys[rs][i]
		if only := onlyIn(g, r); len(only) > 0 {
			diffs = append(diffs, fmt.Sprintf("%s: JSON access log keys only in gozt: %s", role, strings.Join(only, ",")))
		}
		if only := onlyIn(r, g); len(only) > 0 {
			diffs = append(diffs, fmt.Sprintf("%s: JSON access log keys only in rs: %s", role, strings.Join(only, ",")))
		}
	}
	checkDifferences(t, "access-json", diffs)
}

// jsonAccessKeys returns the keys of n's first JSON log record of a completed connection,
// the framing keys (time, level, message, its logger's name) left out; nil if none yet.
func jsonAccessKeys(t *testing.T, n *node) map[string]bool {
	for _, line := range n.logLines() {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) != nil {
			continue
		}
		msg, _ := rec["msg"].(string)
		if m, ok := rec["message"].(string); ok {
			msg = m
		}
		if msg != "connection complete" {
			continue
		}
		keys := map[string]bool{}
		for k := range rec {
			switch k {
			case "time", "timestamp", "level", "msg", "message", "scope", "target":
			default:
				keys[k] = true
			}
		}
		return keys
	}
	return nil
}

// compareViews lists how gozt's views of node A and node B differ from the Rust ztunnel's,
// for the parts the views hold (an empty part compares equal).
func compareViews(views map[string][2]view) []string {
	var diffs []string
	for i, role := range []string{"node A", "node B"} {
		g, r := views[gozt][i], views[rs][i]
		diffs = append(diffs, compareMetrics(role, g.metrics, r.metrics)...)
		if g.first != "" || r.first != "" {
			diffs = append(diffs, compareConnection(role, g.first, r.first)...)
		}
		diffs = append(diffs, compareAccess(role, g.access, r.access)...)
		diffs = append(diffs, compareDump(role, g.dump, r.dump)...)
		for _, k := range slices.Sorted(maps.Keys(g.admin)) {
			if g.admin[k] != r.admin[k] {
				diffs = append(diffs, fmt.Sprintf("%s: %s: gozt=%q, rs=%q", role, k, g.admin[k], r.admin[k]))
			}
		}
	}
	return diffs
}

// observe reads everything of n that TestObservability compares, ending with /quitquitquit.
func observe(t *testing.T, n *node) view {
	t.Helper()
	v := view{metrics: n.metrics(t), access: accessLines(n), admin: map[string]string{}}
	code, body, err := n.get("15000", "/config_dump")
	if err != nil || code != 200 {
		t.Fatalf("%s /config_dump: %d %v", n.prog, code, err)
	}
	v.dump = body
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	answer := func(method, port, path string) string {
		code, body, err := n.host.http(ctx, method, "http://127.0.0.1:"+port+path)
		if err != nil {
			return "error"
		}
		if port != "15021" { // the admin's texts are each program's own; the codes must agree
			return fmt.Sprint(code)
		}
		return fmt.Sprintf("%d %s", code, firstLine(body))
	}
	v.admin["GET /healthz/ready"] = answer(http.MethodGet, "15021", "/healthz/ready")
	v.admin["GET /stats/prometheus"] = strings.Fields(answer(http.MethodGet, "15020", "/stats/prometheus"))[0]
	v.admin["GET /logging"] = answer(http.MethodGet, "15000", "/logging")
	for _, q := range []string{"", "?level=debug", "?level=access:debug", "?level=access=debug", "?level=info,access:debug", "?reset", "?level=bogus", "?level=access:bogus"} {
		v.admin["POST /logging"+q] = answer(http.MethodPost, "15000", "/logging"+q)
	}
	v.admin["GET /quitquitquit"] = answer(http.MethodGet, "15000", "/quitquitquit")
	v.admin["POST /quitquitquit"] = answer(http.MethodPost, "15000", "/quitquitquit")
	select {
	case <-n.Done():
		v.admin["process after POST /quitquitquit"] = "exited"
	case <-time.After(15 * time.Second):
		v.admin["process after POST /quitquitquit"] = "still running after 15s"
	}
	return v
}

// keep writes what was read of a node into $INTEROP_KEEP (a directory), if set, to read the
// two programs side by side: NAME.metrics, NAME.config_dump.json, NAME.access.log.
func keep(t *testing.T, name string, v view) {
	dir := os.Getenv("INTEROP_KEEP")
	if dir == "" {
		return
	}
	for file, data := range map[string]string{".metrics": v.metrics, ".config_dump.json": v.dump, ".access.log": joinLines(v.access)} {
		if err := os.WriteFile(filepath.Join(dir, name+file), []byte(data), 0o644); err != nil {
			t.Error(err)
		}
	}
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(strings.TrimSpace(s), "\n")
	return s
}

// accessLines returns the node's access log records of completed connections.
func accessLines(n *node) []string {
	var out []string
	for _, l := range n.logLines() {
		if strings.Contains(l, "connection complete") {
			out = append(out, l)
		}
	}
	return out
}

// family is what the comparison keeps of one sample name: its family's type and the union
// of its series' label names.
type family struct {
	typ    string
	labels map[string]bool
}

var compared = regexp.MustCompile(`^(istio_|workload_manager_)`)

// parseMetrics reads a Prometheus or OpenMetrics text into sample name -> family, for the
// names TestObservability compares.
func parseMetrics(text string) map[string]*family {
	types := map[string]string{}
	out := map[string]*family{}
	for line := range strings.SplitSeq(text, "\n") {
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			types[f[2]] = f[3]
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, lbls := splitSample(line)
		if !compared.MatchString(name) {
			continue
		}
		fam := out[name]
		if fam == nil {
			fam = &family{typ: sampleType(types, name), labels: map[string]bool{}}
			out[name] = fam
		}
		for k := range lbls {
			fam.labels[k] = true
		}
	}
	return out
}

// sampleType finds the type of the family a sample belongs to (the name itself, or without
// a suffix such as _total or _bucket).
func sampleType(types map[string]string, name string) string {
	if t, ok := types[name]; ok {
		return t
	}
	for _, suffix := range []string{"_total", "_bucket", "_sum", "_count", "_created", "_info"} {
		if t, ok := types[strings.TrimSuffix(name, suffix)]; ok && strings.HasSuffix(name, suffix) {
			return t
		}
	}
	return "untyped"
}

// splitSample parses `name{k="v",...} value` into the name and its labels.
func splitSample(line string) (string, map[string]string) {
	lbls := map[string]string{}
	i := strings.IndexAny(line, "{ ")
	if i < 0 || line[i] == ' ' {
		name, _, _ := strings.Cut(line, " ")
		return name, lbls
	}
	name, rest := line[:i], line[i+1:]
	for len(rest) > 0 && rest[0] != '}' {
		eq := strings.Index(rest, `="`)
		if eq < 0 {
			break
		}
		key := strings.TrimLeft(rest[:eq], ", ")
		rest = rest[eq+2:]
		var val strings.Builder
		for len(rest) > 0 && rest[0] != '"' {
			if rest[0] == '\\' && len(rest) > 1 {
				rest = rest[1:]
			}
			val.WriteByte(rest[0])
			rest = rest[1:]
		}
		lbls[key] = val.String()
		rest = strings.TrimPrefix(rest, `"`)
		rest = strings.TrimPrefix(rest, ",")
	}
	return name, lbls
}

// compareMetrics lists sample names only one program has, and, for those both have, a
// different type or label set.
func compareMetrics(role, gText, rText string) []string {
	g, r := parseMetrics(gText), parseMetrics(rText)
	var diffs []string
	names := slices.Sorted(maps.Keys(g))
	for n := range r {
		if g[n] == nil {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	for _, n := range names {
		gf, rf := g[n], r[n]
		switch {
		case rf == nil:
			diffs = append(diffs, fmt.Sprintf("%s: metric %s only in gozt", role, n))
		case gf == nil:
			diffs = append(diffs, fmt.Sprintf("%s: metric %s only in rs", role, n))
		default:
			if gf.typ != rf.typ {
				diffs = append(diffs, fmt.Sprintf("%s: metric %s type: gozt=%s, rs=%s", role, n, gf.typ, rf.typ))
			}
			if only := onlyIn(gf.labels, rf.labels); len(only) > 0 {
				diffs = append(diffs, fmt.Sprintf("%s: metric %s labels only in gozt: %s", role, n, strings.Join(only, ",")))
			}
			if only := onlyIn(rf.labels, gf.labels); len(only) > 0 {
				diffs = append(diffs, fmt.Sprintf("%s: metric %s labels only in rs: %s", role, n, strings.Join(only, ",")))
			}
		}
	}
	return diffs
}

func onlyIn(a, b map[string]bool) []string {
	var out []string
	for k := range a {
		if !b[k] {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// compareConnection compares the label values each program gives the one connection counted
// in istio_tcp_connections_opened_total.
func compareConnection(role, gText, rText string) []string {
	only := func(text string) map[string]string {
		var found []map[string]string
		for line := range strings.SplitSeq(text, "\n") {
			if name, lbls := splitSample(line); name == "istio_tcp_connections_opened_total" {
				found = append(found, lbls)
			}
		}
		if len(found) != 1 {
			return nil
		}
		return found[0]
	}
	g, r := only(gText), only(rText)
	if g == nil || r == nil {
		return []string{fmt.Sprintf("%s: not exactly one istio_tcp_connections_opened_total series after one connection: gozt %v, rs %v", role, g != nil, r != nil)}
	}
	var diffs []string
	for _, k := range slices.Sorted(maps.Keys(g)) {
		if v, ok := r[k]; ok && v != g[k] {
			diffs = append(diffs, fmt.Sprintf("%s: label %s of the same connection: gozt=%q, rs=%q", role, k, g[k], v))
		}
	}
	return diffs
}

var fieldRE = regexp.MustCompile(`(?:^|\s)([a-z_][a-z0-9_.]*)=`)

// compareAccess compares the field names of the access records of completed connections.
func compareAccess(role string, g, r []string) []string {
	fields := func(lines []string) map[string]bool {
		out := map[string]bool{}
		for _, l := range lines {
			for _, m := range fieldRE.FindAllStringSubmatch(l, -1) {
				out[m[1]] = true
			}
		}
		return out
	}
	gf, rf := fields(g), fields(r)
	for _, framing := range []string{"time", "level", "msg", "scope"} { // slog's, gozt's plain format
		delete(gf, framing)
	}
	var diffs []string
	if only := onlyIn(gf, rf); len(only) > 0 {
		diffs = append(diffs, fmt.Sprintf("%s: access log fields only in gozt: %s", role, strings.Join(only, ",")))
	}
	if only := onlyIn(rf, gf); len(only) > 0 {
		diffs = append(diffs, fmt.Sprintf("%s: access log fields only in rs: %s", role, strings.Join(only, ",")))
	}
	return diffs
}

// compareDump compares the shapes of the parts of two /config_dump documents that istioctl's
// ztunnel-config views read (workloads, services, policies, certificates, workloadState;
// not each program's own config): every path of object keys (arrays as [], keys that are
// data — addresses, names with / or : — as *) with its JSON type.
func compareDump(role, g, r string) []string {
	gp, gerr := shape(g)
	rp, rerr := shape(r)
	for _, p := range []map[string]bool{gp, rp} {
		for k := range p {
			if strings.HasPrefix(k, ".config.") || k == ".config:{}" {
				delete(p, k)
			}
		}
	}
	if gerr != nil || rerr != nil {
		return []string{fmt.Sprintf("%s: /config_dump is not JSON: gozt %v, rs %v", role, gerr, rerr)}
	}
	var diffs []string
	if only := subtrees(onlyIn(gp, rp), rp); len(only) > 0 {
		diffs = append(diffs, fmt.Sprintf("%s: /config_dump keys only in gozt: %s", role, strings.Join(only, " ")))
	}
	if only := subtrees(onlyIn(rp, gp), gp); len(only) > 0 {
		diffs = append(diffs, fmt.Sprintf("%s: /config_dump keys only in rs: %s", role, strings.Join(only, " ")))
	}
	return diffs
}

// subtrees shortens each path to its first key the other document does not have at all:
// one entry for a whole section only one program writes.
func subtrees(paths []string, other map[string]bool) []string {
	has := map[string]bool{} // every key path of other, without types
	for p := range other {
		p, _, _ = strings.Cut(p, ":")
		for i := range p {
			if p[i] == '.' && i > 0 {
				has[p[:i]] = true
			}
		}
		has[p] = true
	}
	seen := map[string]bool{}
	var out []string
	for _, p := range paths {
		p, _, _ = strings.Cut(p, ":")
		short := p
		for i := 1; i < len(p); i++ {
			if p[i] == '.' && !has[p[:i]] {
				short = p[:i]
				break
			}
		}
		if !seen[short] {
			seen[short] = true
			out = append(out, short)
		}
	}
	slices.Sort(out)
	return out
}

func shape(doc string) (map[string]bool, error) {
	var v any
	if err := json.Unmarshal([]byte(doc), &v); err != nil {
		return nil, err
	}
	out := map[string]bool{}
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			if len(v) == 0 {
				out[path+":{}"] = true
			}
			for k, e := range v {
				if strings.ContainsAny(k, "/:") || net.ParseIP(k) != nil {
					k = "*"
				}
				walk(path+"."+k, e)
			}
		case []any:
			if len(v) == 0 {
				out[path+":[]"] = true
			}
			for _, e := range v {
				walk(path+"[]", e)
			}
		case string:
			out[path+":string"] = true
		case float64:
			out[path+":number"] = true
		case bool:
			out[path+":bool"] = true
		case nil:
			out[path+":null"] = true
		}
	}
	walk("", v)
	return out, nil
}
