package h2upstream

import "testing"

func TestGetBuf(t *testing.T) {
	for _, tc := range []struct{ n, cap int }{
		{1, 1 << 10}, {1024, 1 << 10}, {1025, 2 << 10}, {16 << 10, 16 << 10}, {64 << 10, 64 << 10}, {64<<10 + 1, 64<<10 + 1},
	} {
		b := getBuf(tc.n)
		if cap(*b) != tc.cap || len(*b) != 0 {
			t.Errorf("getBuf(%d): cap %d len %d, want cap %d", tc.n, cap(*b), len(*b), tc.cap)
		}
		*b = append(*b, 1)
		putBuf(b)
	}
}
