package testutil

import (
	"crypto/fips140"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
)

// fipsChildEnv marks the child InFIPSMode starts, so that a child whose GODEBUG did not
// take fails instead of starting another.
const fipsChildEnv = "GOZT_TEST_FIPS_CHILD"

// InFIPSMode reports whether the calling top-level test runs in FIPS 140-3 mode. The mode
// is process-wide and fixed at start, so when it is off InFIPSMode runs t alone again in a
// child process of the same test binary with GODEBUG=fips140=on added, reports the
// child's failure as t's, and returns false: the caller returns. In the child it returns
// true and the test carries on there.
//
// GODEBUG=fips140=on is valid on a binary built without GOFIPS140: crypto/tls and the
// other packages apply the same FIPS 140-3 policy, over the toolchain's own copy of the Go
// Cryptographic Module instead of a frozen, validated one (crypto/fips140.Version says
// "latest"). What the module is made of is the build's business (make image FIPS=1); what
// the mode allows is the same.
func InFIPSMode(t *testing.T) bool {
	t.Helper()
	if fips140.Enabled() {
		return true
	}
	if os.Getenv(fipsChildEnv) != "" {
		t.Fatal("GODEBUG=fips140=on did not turn FIPS 140-3 mode on in the child process")
	}
	if strings.Contains(t.Name(), "/") {
		t.Fatal("InFIPSMode is for top-level tests: the child runs the test by name")
	}
	args := []string{"-test.run=^" + regexp.QuoteMeta(t.Name()) + "$", "-test.count=1", "-test.v"}
	if d, ok := t.Deadline(); ok { // the child ends by itself if the parent's time runs out
		args = append(args, "-test.timeout="+time.Until(d).Round(time.Second).String())
	}
	cmd := exec.Command(os.Args[0], args...)
	godebug := "fips140=on"
	if g := os.Getenv("GODEBUG"); g != "" {
		godebug = g + "," + godebug // the last setting of a key wins
	}
	cmd.Env = append(os.Environ(), "GODEBUG="+godebug, fipsChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("in FIPS 140-3 mode (child process, GODEBUG=%s): %v\n%s", godebug, err, out)
	}
	if !strings.Contains(string(out), "--- PASS: "+t.Name()) {
		t.Fatalf("the FIPS 140-3 child ran no %s:\n%s", t.Name(), out)
	}
	t.Logf("passed in FIPS 140-3 mode (child process, GODEBUG=%s)", godebug)
	return false
}
