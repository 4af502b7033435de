package otlptest

import (
	"strings"
	"testing"
)

// Without the collector built, tests are told how to build it (Start skips with this).
func TestBinaryMissing(t *testing.T) {
	t.Setenv("OTELCOL", "")
	t.Chdir(t.TempDir())
	if _, err := Binary(); err == nil || !strings.Contains(err.Error(), "make otelcol") {
		t.Errorf("no collector anywhere above: %v; want an error saying to run make otelcol", err)
	}
	t.Setenv("OTELCOL", "/nonexistent/otelcol")
	if _, err := Binary(); err == nil || !strings.Contains(err.Error(), "OTELCOL=/nonexistent/otelcol") {
		t.Errorf("OTELCOL naming a missing file: %v; want an error naming it", err)
	}
}
