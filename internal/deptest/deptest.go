// Package deptest enforces the import rules of docs/ARCHITECTURE.md: imports point down,
// never up. Its test lists every package of the module with `go list -deps` and fails on any
// import the table below forbids, and on a rule naming a package that no longer exists
// (which would check nothing). Its TestSwitchesDocumented holds docs/TESTING.md's table of
// test switches to the environment variables and flags the tests read.
package deptest

import (
	"fmt"
	"sort"
	"strings"
)

// Module is the module path the rules are written against.
const Module = "github.com/gozt/gozt"

// Rule forbids imports for one package (and, with Subtree, the packages below it).
type Rule struct {
	Pkg     string   // module-relative, e.g. "hbone"
	Subtree bool     // also applies to Pkg/...
	Forbid  []string // module-relative packages; "..." suffix = subtree; "*" = the whole module
	Allow   []string // exceptions to Forbid (module-relative)
	Direct  []string // standard packages Pkg itself must not import directly (e.g. I/O)
	// External: packages outside the module ("..." suffix = subtree) Pkg must not depend on,
	// directly or transitively.
	External []string
	Why      string
}

// Rules is the table from docs/ARCHITECTURE.md.
var Rules = []Rule{
	{Pkg: "identity", Forbid: []string{"*"}, Why: "leaf: SPIFFE ID value types everything uses"},
	{Pkg: "xds/xdspb", Forbid: []string{"*"}, Why: "generated protobuf code is a leaf"},
	{Pkg: "xds/xdspb/discoverypb", Forbid: []string{"*"}, Why: "generated delta ADS protos and gRPC stubs are a leaf"},
	{Pkg: "xds/state", Forbid: []string{"xds", "xds/xdspb", "proxy...", "hbone..."}, Direct: []string{"google.golang.org/protobuf..."}, Why: "the cache holds plain Go types; protos are converted in xds"},
	{Pkg: "hbone", Subtree: true, Forbid: []string{"xds...", "proxy...", "identity/certs"}, Why: "the wire protocol knows nothing of workloads or where certificates come from"},
	{Pkg: "proxy", Forbid: []string{"xds", "identity/certs...", "identity/ca..."}, Why: "the data plane gets state and certificates through interfaces, not from their sources"},
	{Pkg: "proxy/rbac", Forbid: []string{"*"}, Allow: []string{"identity", "xds/state"}, Direct: []string{"net", "net/http", "os", "io", "log/slog"}, Why: "pure authorization: no I/O"},
	{Pkg: "proxy/outlier", Forbid: []string{"*"}, Allow: []string{"identity", "xds/state"}, Direct: []string{"net", "os", "io", "log/slog"}, Why: "endpoint bookkeeping only: the proxy does the I/O and the logging"},
	{Pkg: "xds", Forbid: []string{"proxy...", "hbone...", "identity/certs..."}, Why: "the control-plane client feeds the cache, nothing else"},
	{Pkg: "identity/ca/capb", Forbid: []string{"*"}, Why: "generated CA protos and gRPC stubs are a leaf"},
	{Pkg: "identity/ca", Subtree: true, Forbid: []string{"proxy...", "xds...", "hbone..."}, Why: "CA clients know nothing of the data plane"},
	{Pkg: "identity/certs", Forbid: []string{"proxy...", "xds...", "hbone..."}, Why: "the certificate manager knows nothing of the data plane"},
	{Pkg: "metrics", Forbid: []string{"*"}, Allow: []string{"identity"}, Why: "a leaf every layer may record into"},
	{Pkg: "dns", Forbid: []string{"proxy...", "hbone...", "xds"}, Why: "the DNS proxy reads the cache only"},
	{Pkg: "inpod/zdspb", Forbid: []string{"*"}, Why: "generated ZDS protos are a leaf"},
	{Pkg: "inpod", Subtree: true, Forbid: []string{"xds", "identity/certs..."}, Why: "a pod is acknowledged without waiting on xDS or the CA; proxies get both from cmd's wiring"},
	{Pkg: "proxy", Subtree: true, Forbid: []string{"inpod..."}, Why: "the data plane takes a socket factory (internal/netns) and knows nothing of ZDS"},
	{Pkg: "internal", Subtree: true, Forbid: []string{"cmd...", "proxy...", "hbone...", "xds...", "identity/ca...", "identity/certs...", "metrics", "bench..."}, Why: "small shared pieces sit below everything"},
	{Pkg: "*", Forbid: []string{"cmd...", "bench..."}, Why: "nothing imports a command or the load generator"},
	{Pkg: "*", Forbid: []string{"internal/netns/netnstest"}, Why: "test namespaces are for tests; production enters namespaces with internal/netns"},
	{Pkg: "*", Forbid: []string{"hbone/hbonetest"}, Why: "the test east-west gateway is for tests"},
	{Pkg: "*", Forbid: []string{"internal/attack"}, Why: "attack traffic is for tests and benchmarks"},
	{Pkg: "*", Forbid: []string{"internal/child"}, Why: "starting ztunnel processes is for tests and benchmarks"},
	{Pkg: "cmd/ztunnel", Forbid: []string{"internal/netns/netnstest", "inpod/inpodtest", "inpod/zdsagent"}, Why: "the node binary links no test helper and no node agent stand-in"},
	{Pkg: "inpod", Forbid: []string{"inpod/zdsagent", "inpod/inpodtest"}, Why: "the ZDS client does not link the agent that stands in for istio-cni"},
	{Pkg: "inpod", Forbid: []string{"inpod/podproxy", "proxy...", "dns"}, Why: "the workload manager drives the pods' proxies through its Proxies interface only: its state machine links no data plane, and its tests run it with a fake"},
	{Pkg: "cmd/ztunnel", External: buildTooling, Why: "the node binary links no image or chart tooling (cmd/mkimage, tools/)"},
	{Pkg: "*", External: buildTooling, Why: "image and chart tooling is for cmd/mkimage, the local cluster's image builder (deploy/cluster/mkimg) and tools/ only"},
}

var buildTooling = []string{"github.com/google/go-containerregistry...", "helm.sh/helm..."}

// Package is one node of the import graph: its module-relative path and what it imports,
// directly and transitively (full import paths).
type Package struct {
	Path    string
	Imports []string
	Deps    []string
}

// Check returns one line per violation, sorted.
func Check(pkgs []Package, rules []Rule) []string {
	var out []string
	for _, p := range pkgs {
		for _, r := range rules {
			if !r.applies(p.Path) {
				continue
			}
			for _, d := range p.Deps {
				for _, e := range r.External {
					if match(e, d) {
						out = append(out, fmt.Sprintf("%s imports %s (%s)", p.Path, d, r.Why))
					}
				}
				rel, inModule := relative(d)
				if !inModule || rel == p.Path || (r.Pkg == "*" && strings.HasPrefix(p.Path, "cmd")) {
					continue
				}
				if r.forbids(rel) {
					out = append(out, fmt.Sprintf("%s imports %s (%s)", p.Path, rel, r.Why))
				}
			}
			for _, imp := range p.Imports {
				for _, f := range r.Direct {
					if match(f, imp) {
						out = append(out, fmt.Sprintf("%s imports %s directly (%s)", p.Path, imp, r.Why))
					}
				}
			}
		}
	}
	sort.Strings(out)
	return out
}

// Stale returns one line per name in rules that matches no package of pkgs, sorted: a rule
// about a package that was renamed or removed checks nothing and must be updated. Pkg,
// Forbid and Allow are matched against the module's packages ("..." against the subtree,
// "*" always matches); Direct against everything they import.
func Stale(pkgs []Package, rules []Rule) []string {
	module := make(map[string]bool, len(pkgs))
	deps := make(map[string]bool)
	for _, p := range pkgs {
		module[p.Path] = true
		for _, d := range p.Deps {
			deps[d] = true
		}
	}
	exists := func(set map[string]bool, pattern string) bool {
		if pattern == "*" || set[strings.TrimSuffix(pattern, "...")] {
			return true
		}
		for p := range set {
			if match(pattern, p) {
				return true
			}
		}
		return false
	}
	var out []string
	for _, r := range rules {
		pkg := r.Pkg
		if r.Subtree {
			pkg += "..."
		}
		if !exists(module, pkg) {
			out = append(out, fmt.Sprintf("rule for %s: no such package", r.Pkg))
		}
		for _, f := range append(append([]string(nil), r.Forbid...), r.Allow...) {
			if !exists(module, f) {
				out = append(out, fmt.Sprintf("rule for %s names %s: no such package", r.Pkg, f))
			}
		}
		for _, f := range r.Direct {
			if !exists(deps, f) {
				out = append(out, fmt.Sprintf("rule for %s names %s: no package of the module imports it", r.Pkg, f))
			}
		}
	}
	sort.Strings(out)
	return out
}

func (r Rule) applies(pkg string) bool {
	if strings.HasSuffix(pkg, "_test") {
		return false
	}
	switch {
	case r.Pkg == "*": // not the commands: cmd/..., bench, and the local cluster's (deploy/cluster/...)
		return !strings.HasPrefix(pkg, "bench") && !strings.HasPrefix(pkg, "cmd") && !strings.HasPrefix(pkg, "deploy/cluster/")
	case r.Subtree:
		return pkg == r.Pkg || strings.HasPrefix(pkg, r.Pkg+"/")
	default:
		return pkg == r.Pkg
	}
}

func (r Rule) forbids(dep string) bool {
	for _, a := range r.Allow {
		if dep == a {
			return false
		}
	}
	for _, f := range r.Forbid {
		if f == "*" || match(f, dep) {
			return true
		}
	}
	return false
}

// match reports whether path matches pattern, where a trailing "..." matches the package and
// everything below it.
func match(pattern, path string) bool {
	if base, ok := strings.CutSuffix(pattern, "..."); ok {
		return path == base || strings.HasPrefix(path, base+"/")
	}
	return path == pattern
}

func relative(importPath string) (string, bool) {
	if importPath == Module {
		return "", true
	}
	rel, ok := strings.CutPrefix(importPath, Module+"/")
	return rel, ok
}
