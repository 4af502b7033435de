package deptest

import (
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"strings"
	"testing"
)

// TestImportRules checks the real module against the table.
func TestImportRules(t *testing.T) {
	cmd := exec.Command("go", "list", "-deps=false", "-json=ImportPath,Imports,Deps", Module+"/...")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	var pkgs []Package
	for {
		var p struct {
			ImportPath    string
			Imports, Deps []string
		}
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		rel, _ := relative(p.ImportPath)
		pkgs = append(pkgs, Package{Path: rel, Imports: p.Imports, Deps: p.Deps})
	}
	if len(pkgs) < 3 {
		t.Fatalf("go list found only %d packages; the test is not looking at the module", len(pkgs))
	}
	for _, v := range Check(pkgs, Rules) {
		t.Error(v)
	}
	for _, v := range Stale(pkgs, Rules) {
		t.Error(v)
	}
}

// TestStaleCatchesMissingPackages shows a rule naming a package the module no longer has
// is reported, in each place a rule can name one.
func TestStaleCatchesMissingPackages(t *testing.T) {
	pkgs := []Package{
		{Path: "hbone", Deps: []string{"net"}},
		{Path: "internal/reuse"},
		{Path: "xds/state"},
	}
	rules := []Rule{
		{Pkg: "hbone", Forbid: []string{"xds...", "*"}, Direct: []string{"net"}},                  // all exist
		{Pkg: "internal", Subtree: true, Forbid: []string{"xds/state"}, Allow: []string{"hbone"}}, // subtree without a root package
		{Pkg: "gone", Forbid: []string{"xds/gone", "old..."}, Allow: []string{"was"}, Direct: []string{"net/nope"}},
		{Pkg: "xds", Subtree: false},
	}
	got := Stale(pkgs, rules)
	want := []string{
		"rule for gone names net/nope: no package of the module imports it",
		"rule for gone names old...: no such package",
		"rule for gone names was: no such package",
		"rule for gone names xds/gone: no such package",
		"rule for gone: no such package",
		"rule for xds: no such package",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("Stale =\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestCheckCatchesViolations shows each kind of forbidden import is reported.
func TestCheckCatchesViolations(t *testing.T) {
	m := func(rel string) string { return Module + "/" + rel }
	pkgs := []Package{
		{Path: "hbone", Deps: []string{m("identity"), m("xds/state"), "golang.org/x/net/http2"}},
		{Path: "identity", Deps: []string{m("metrics")}},
		{Path: "proxy/rbac", Imports: []string{"net"}, Deps: []string{m("identity"), m("xds/state"), "net"}},
		{Path: "proxy", Deps: []string{m("xds/state"), m("hbone"), m("identity/certs")}},
		{Path: "xds", Deps: []string{m("cmd/ztunnel")}},
		{Path: "inpod", Deps: []string{m("inpod/zdspb"), m("xds/state"), m("xds")}},
		{Path: "proxy", Deps: []string{m("inpod")}},
		{Path: "xds/state", Imports: []string{"google.golang.org/protobuf/proto"}},
		{Path: "metrics", Deps: []string{m("identity")}},            // allowed
		{Path: "cmd/ztunnel", Deps: []string{m("proxy"), m("xds")}}, // allowed
		{Path: "cmd/ztunnel", Deps: []string{"github.com/google/go-containerregistry/pkg/v1"}},
		{Path: "cmd/mkimage", Deps: []string{"github.com/google/go-containerregistry/pkg/v1"}},          // allowed
		{Path: "deploy/cluster/mkimg", Deps: []string{"github.com/google/go-containerregistry/pkg/v1"}}, // allowed
	}
	got := Check(pkgs, Rules)
	want := []string{
		"cmd/ztunnel imports github.com/google/go-containerregistry/pkg/v1",
		"hbone imports xds/state",
		"identity imports metrics",
		"inpod imports xds ",
		"proxy imports identity/certs",
		"proxy imports inpod ",
		"proxy/rbac imports net directly",
		"xds imports cmd/ztunnel",
		"xds/state imports google.golang.org/protobuf/proto directly",
	}
	if len(got) != len(want) {
		t.Fatalf("got %d violations; want %d:\n%s", len(got), len(want), strings.Join(got, "\n"))
	}
	for i := range want {
		if !strings.HasPrefix(got[i], want[i]) {
			t.Errorf("violation %d = %q; want prefix %q", i, got[i], want[i])
		}
	}
}
