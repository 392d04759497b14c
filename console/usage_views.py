"""The console's usage pages (stubs: being built)."""
from django.http import HttpResponse


def usage(request):
    return HttpResponse("not yet", status=501)


usage_csv = usage
