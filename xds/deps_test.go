package xds

import (
	"os/exec"
	"strings"
	"testing"
)

// TestImports enforces ARCHITECTURE.md's import rules for the xds packages.
func TestImports(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go command not in PATH")
	}
	const mod = "github.com/gozt/gozt/"
	for pkg, forbidden := range map[string][]string{
		// state is plain Go: readable and testable without the wire format.
		"xds/state": {mod + "xds", mod + "xds/xdspb", "google.golang.org/protobuf", mod + "proxy", mod + "hbone"},
		// xds feeds the cache; it must not reach into the data plane or certificates.
		// go-control-plane is replaced by xds/xdspb/discoverypb: its types were half the binary.
		"xds": {mod + "proxy", mod + "hbone", mod + "identity/certs", "github.com/envoyproxy"},
		// generated code is a leaf.
		"xds/xdspb/workloadpb":  {mod},
		"xds/xdspb/securitypb":  {mod},
		"xds/xdspb/discoverypb": {mod, "github.com/envoyproxy"},
	} {
		out, err := exec.Command(goBin, "list", "-deps", mod+pkg).Output()
		if err != nil {
			t.Fatalf("go list %s: %v", pkg, err)
		}
		for _, dep := range strings.Fields(string(out)) {
			if dep == mod+pkg {
				continue
			}
			for _, f := range forbidden {
				if dep == f || strings.HasPrefix(dep, strings.TrimSuffix(f, "/")+"/") {
					t.Errorf("%s imports %s", pkg, dep)
				}
			}
		}
	}
}
